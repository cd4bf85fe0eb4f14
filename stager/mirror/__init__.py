"""The mirror pipeline: a node's models from the NAS hub into its local hub, verified.

    walk     hub.py           the NAS hub, read-only: refs, snapshots, link chains -> Entry values
    observe  observe.py       what the node already holds, with fingerprints -> observations
             fingerprint.py   sampled and full digests, and the one comparison rule
    plan     plan.py          pure: copy, link, skip or refuse each entry -> actions
    execute  execute.py       the only writer: copies (copier.py), links, refs, store modes
             store_modes.py   how payloads are laid out (per-repo blobs or a shared store)
    verify   verify.py        the ladder, sampled then full, with the same comparison rule
             records.py       SHA256SUMS, MOVED.txt and the journal, read and written one way
             safetensors_header.py  a weight file's header, parsed without trusting it
    pipeline.py               `stage mirror`: walk -> observe -> plan -> execute -> verify, under the hub lock
"""
