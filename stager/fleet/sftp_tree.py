"""The SFTP peer tree (`stage fleet mirror --fan-out`, `--transport sftp`): for sites where the
nodes reach each other over SSH only.

One node stages from its own source (the NAS); every node that finishes with exit 0 and has an
`address` then serves one peer at a time, as that peer's `stage mirror --source
sftp://<address><its hub>`, so the staged set doubles each round and each byte leaves the NAS
once. Served nodes still verify against the NAS (see mirror.reference_source). The bytes move
inside each node's own `stage mirror`; this module only says who serves whom.
"""

from __future__ import annotations

from stager.base.errors import EXIT_OK
from stager.fleet.report import NodeRun, unreachable
from stager.manifest import Manifest


def peer_url(manifest: Manifest, node: str) -> str:
    """The SFTP URL of a staged node's local hub, for its peers."""
    config = manifest.nodes[node]
    return f"sftp://{config.address}{config.hub}"


def fan_out(driver, names: list[str]) -> dict[str, NodeRun]:
    """Each staged node serves one peer at a time; a node no staged or staging node can serve
    (other models, no address) stages from its own source. Nodes with a `source` of their own
    in the manifest keep it."""
    nodes = driver.manifest.nodes
    # Nodes with an address go first: only they can pass the data on.
    pending = sorted(driver.present(names), key=lambda n: nodes[n].address is None)
    idle: list[str] = []
    serving: dict[str, str] = {}  # staging node -> the peer serving it

    def can_serve(server: str, node: str) -> bool:
        return bool(nodes[server].address) and set(nodes[node].models) <= set(nodes[server].models)

    while pending or driver.running:
        for node in list(pending):
            server = next((s for s in idle if can_serve(s, node)), None)
            if nodes[node].source is None and server is not None:
                idle.remove(server)
                serving[node] = server
                driver.launch(node, peer_url(driver.manifest, server))
                pending.remove(node)
                continue
            coming = [part.node for part in driver.running.values()] + list(serving.values())
            if nodes[node].source is not None or not any(can_serve(s, node) for s in coming):
                driver.launch(node)
                pending.remove(node)
        run = driver.wait_one()
        if run is None:
            break
        if run.node in serving:
            idle.append(serving.pop(run.node))
        if run.exit_code == EXIT_OK and nodes[run.node].address:
            idle.append(run.node)
    driver.give_up()
    for node in pending:
        driver.runs[node] = unreachable(node, f"not started: no peer was staged within {driver.timeout:g}s")
    return driver.runs
