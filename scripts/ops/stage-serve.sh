#!/usr/bin/env bash
# Start an inference container on this node: `stage verify` is the pre-serve gate, then
# `docker run` with the node's models bound read-only, staged files first and the NAS as the
# fallback for what is not staged (excluded entries). Both kinds of bind are read-only.
#
#   scripts/ops/stage-serve.sh IMAGE [ARG...]
#
# Environment: STAGE_NODE (default: this host's short name), STAGE_MANIFEST (read by stage),
# CONTAINER_HUB (HF_HUB_CACHE inside the container, default /hf/hub), STAGE_VERIFY_ARGS
# (e.g. "--full"), DOCKER_ARGS (more `docker run` options, split on spaces), STAGE and DOCKER
# (the commands, default stage and docker).
#
# Exit: the gate's code when the node does not verify (1 problems, 2 bad manifest, 3 could not
# run), and then no container is started; else docker's.
set -euo pipefail

image=${1:?usage: stage-serve.sh IMAGE [ARG...]}
shift
node=${STAGE_NODE:-$(hostname -s)}
hub=${CONTAINER_HUB:-/hf/hub}
stage=${STAGE:-stage}

# The gate. Its report goes to stderr with the rest of this script's log.
gate=0
# shellcheck disable=SC2086  # STAGE_VERIFY_ARGS is a list of options
"$stage" verify --node "$node" ${STAGE_VERIFY_ARGS:-} >&2 || gate=$?
if [ "$gate" -ne 0 ]; then
    echo "stage-serve: $node did not pass stage verify (exit $gate); not starting $image" >&2
    exit "$gate"
fi

# One `-v 'SOURCE:TARGET:ro'` per line, shell-quoted by stage; eval turns the lines into words.
lines=$("$stage" binds --node "$node" --container-hub "$hub")
eval "binds=($lines)"

# shellcheck disable=SC2086  # DOCKER_ARGS is a list of options
exec "${DOCKER:-docker}" run --rm "${binds[@]}" ${DOCKER_ARGS:-} \
    -e HF_HUB_CACHE="$hub" -e HF_HUB_OFFLINE=1 "$image" "$@"
