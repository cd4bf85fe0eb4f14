"""The broadcast transport: the bytes two or more nodes need, read once from the NAS by the head
of a chain over exactly those nodes, each chunk keyed by the run's key and checked by every node
before it is written or passed on (docs/fleet.md, "The broadcast").

`keys` is the run's key (membership and chunk integrity), `gate` a relay's listener (every
handshake, bounded, in one loop; who was refused), `relay` a node's part (inside its Ray actor),
`chain` the driver's side (start the relays, run each chain, collect what came from
where). The driver decides which files and which nodes; this package only moves and checks bytes.
"""
