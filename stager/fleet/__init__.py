"""`stage fleet`: one command for every node at once, run by Ray actors pinned to the nodes.

The rooms: `options` checks what the command is told, once, before any node is asked anything;
`driver` decides which node runs what and collects what each reported; `liveness` tells it which
nodes are still there (Ray node gone, agent dead, a node's actor silent: `stalled`); `cluster`
joins the Ray cluster, and only one that refuses strangers; `node` is a node's node-local command,
in an actor that answers while it runs; `agent` is a broadcast node's actor for the run (its plan,
relay and closing mirror in one process); `report` is the per-node outcome and the table; `live`
is each node's part as it goes (a line per node on a terminal) and the warning for nodes that read
the NAS instead of their peers; `sftp_tree` is the SFTP peer tree (--fan-out), and `broadcast/`
the pipelined, keyed chain: transports, which move and check bytes; `needs` is the driver's
decision of who needs which file, and `choice` (with the agents' measures, `probe`) its choice, per
group of files, between the broadcast and direct reads.

Nothing is imported here: an agent's or a node command's Ray worker imports its own module by name
(agent, node), and loading the driver's rooms with it doubled what a node command's worker spent
on its imports (71 against 36 ms of CPU).
"""
