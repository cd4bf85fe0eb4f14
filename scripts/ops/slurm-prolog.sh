#!/bin/bash
# Slurm Prolog: stage this node before a job starts, and drain it if it cannot be staged.
#
# slurm.conf:  Prolog=/etc/stager/slurm-prolog.sh   PrologFlags=Alloc
# `stage mirror` copies what the NAS's refs name and the node lacks, then verifies (a node already
# staged costs a fraction of a second). A mirror already running (cron) is waited for, up to
# STAGE_WAIT seconds. Exit codes and settings: docs/operations.md, "Slurm".
set -u
role=stage-prolog
# shellcheck source=slurm-common.sh
. "$(dirname "$(readlink -f "$0")")/slurm-common.sh"

run_stage mirror --node "$STAGE_NODE" --wait "$STAGE_WAIT"
skip_absent_node
finish "$rc" "stage mirror" "$error"
