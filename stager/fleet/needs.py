"""Who needs what, decided by the driver from each node's own plan (`stage mirror --dry-run
--json`): the files that two or more nodes must copy from the NAS, grouped by the set of nodes
that need them. A transport moves each group among exactly its nodes; a file only one node needs
is left to that node's own mirror, which reads it from the NAS, and so is a file of at most 1 MiB
(SAMPLED_WHOLE), which every node's sampled check reads whole from the NAS anyway.

A file's identity is (its name in the node hub, its name on the NAS, its size): the name of a
blob is its content hash, so nodes with different models, excludes or revisions share exactly
the blobs they have in common, and a node that holds a verified copy does not list it (its plan
keeps it) and so neither receives it nor makes the others wait for it.
"""

from __future__ import annotations

from stager.mirror.fingerprint import HEAD_BYTES, INTERIOR_BYTES, INTERIOR_CHUNKS, TAIL_BYTES, Reference
from stager.fleet.broadcast.relay import Share
from stager.fleet.report import NodeRun
from stager.manifest import Manifest

# A file no larger than the regions a sampled check reads is read whole from the NAS by every
# node's own check anyway: sending it down a chain would save no NAS byte and cost a round trip.
SAMPLED_WHOLE = HEAD_BYTES + INTERIOR_CHUNKS * INTERIOR_BYTES + TAIL_BYTES
# A file whose plan names no reference: its own bytes, hashed as they are read.
UNNAMED = {"method": "blake3", "value": None, "origin": "source copy"}


def shared_files(manifest: Manifest, plans: dict[str, NodeRun]) -> list[tuple[tuple[str, ...], tuple[Share, ...]]]:
    """(nodes, files) per set of nodes, nodes in the order given (the first is the chain's head).
    Only nodes that stage from the NAS itself and have an address take part: a node with a
    `source` of its own keeps it."""
    wanted: dict[tuple[str, str, int], list[str]] = {}
    references: dict[tuple[str, str, int], Reference] = {}  # what --full checks each file against
    for name, run in plans.items():
        report = run.report or {}
        if run.exit_code > 1 or report.get("source") != manifest.nas.hub or not manifest.nodes[name].address:
            continue
        for item in report.get("would_copy") or []:
            identity = (item["path"], item["source"], int(item["bytes"]))
            wanted.setdefault(identity, []).append(name)
            references.setdefault(identity, Reference(**item.get("reference", UNNAMED)))
    groups: dict[tuple[str, ...], list[Share]] = {}
    for identity, members in sorted(wanted.items()):
        if len(members) >= 2 and identity[2] > SAMPLED_WHOLE:
            groups.setdefault(tuple(members), []).append(Share(*identity, references[identity]))
    return [(members, tuple(files)) for members, files in groups.items()]
