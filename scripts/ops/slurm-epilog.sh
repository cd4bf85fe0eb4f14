#!/bin/bash
# Slurm Epilog: after a job, check that the node's staging is still whole, repair it if not, and
# drain the node if it cannot be repaired: a job can write into the hub cache it was given, and
# the next job must not load what it left.
#
# slurm.conf:  Epilog=/etc/stager/slurm-epilog.sh
# Exit codes and settings: docs/operations.md, "Slurm".
set -u
role=stage-epilog
# shellcheck source=slurm-common.sh
. "$(dirname "$(readlink -f "$0")")/slurm-common.sh"

run_stage verify --node "$STAGE_NODE"
skip_absent_node
[ "$rc" -eq 0 ] && exit 0
say "job ${SLURM_JOB_ID:-?} on $STAGE_NODE: stage verify exit $rc ($(meaning "$rc")): ${error:-see stage verify}; repairing"
run_stage mirror --node "$STAGE_NODE" --wait "$STAGE_WAIT"
finish "$rc" "stage mirror" "$error"
