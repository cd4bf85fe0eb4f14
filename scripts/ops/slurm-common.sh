# Shared by slurm-prolog.sh and slurm-epilog.sh: settings, logging, and how a stage exit code
# becomes the script's (docs/operations.md, "Slurm"). Sourced, not run.

# slurmd runs prologs and epilogs with no search path of their own.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() {
  # stderr reaches slurmd's log; syslog keeps it beside the node's other events.
  echo "$role: $*" >&2
  logger -t stage-slurm -- "$role: $*" 2>/dev/null || true
}

# Settings come from this file, since slurmd passes the script only its own variables.
# STAGE_SLURM_CONF names another file (or none, when it does not exist).
conf=${STAGE_SLURM_CONF:-/etc/stager/slurm.env}
if [ -e "$conf" ] && [ ! -f "$conf" ]; then
  # Sourcing a FIFO waits for a writer for ever, and slurmd with it.
  say "$conf: not a regular file; the node drains"
  exit 2
fi
if [ -r "$conf" ]; then
  # shellcheck source=/dev/null
  . "$conf"
fi
STAGE=${STAGE:-/usr/local/bin/stage}                           # the installed stage command
export STAGE_MANIFEST=${STAGE_MANIFEST:-/etc/stager/cluster.toml}
STAGE_NODE=${STAGE_NODE:-${SLURMD_NODENAME:-$(hostname -s)}}   # the manifest's name for this node
STAGE_WAIT=${STAGE_WAIT:-1800}       # seconds to wait for a stage mirror already writing the node hub
STAGE_TOLERATE=${STAGE_TOLERATE:-}   # stage exit codes that still let jobs run, e.g. "3"

# A setting that is not a number fails here, with one line naming it: `STAGE_WAIT=inf` once made
# the prolog wait for ever, and slurmd's job with it. The range is stage's own --wait range.
case $STAGE_WAIT in
  '' | *[!0-9]*) wait_ok=no ;;
  *) [ "${#STAGE_WAIT}" -le 5 ] && [ "$STAGE_WAIT" -le 86400 ] && wait_ok=yes || wait_ok=no ;;
esac
if [ "$wait_ok" = no ]; then
  say "STAGE_WAIT=$STAGE_WAIT in $conf: expected whole seconds from 0 to 86400; the node drains"
  exit 2
fi
for code in $STAGE_TOLERATE; do
  case $code in
    '' | *[!0-9]*)
      say "STAGE_TOLERATE=$STAGE_TOLERATE in $conf: expected stage exit codes such as 3; the node drains"
      exit 2 ;;
  esac
done

meaning() {
  case $1 in
    1) echo "problems found" ;;
    2) echo "bad manifest or arguments" ;;
    3) echo "could not run" ;;
    130 | 143) echo "interrupted" ;;
    *) echo "unexpected" ;;
  esac
}

# finish RC WHAT ERROR: end the script for a stage exit code. 0 lets the job run. Any other
# code drains the node (slurmd does that for a non-zero prolog or epilog, and requeues the job
# of a failed prolog), unless it is listed in STAGE_TOLERATE: a node hub only ever moves from
# one whole snapshot to the next, so a tolerated failure leaves jobs the last whole one.
finish() {
  local rc=$1 what=$2 error=$3
  [ "$rc" -eq 0 ] && exit 0
  local why="job ${SLURM_JOB_ID:-?} on $STAGE_NODE: $what exit $rc ($(meaning "$rc")): ${error:-no message}"
  local ok
  for ok in $STAGE_TOLERATE; do
    if [ "$ok" = "$rc" ]; then
      say "$why; tolerated, jobs run on the last whole snapshot staged"
      exit 0
    fi
  done
  say "$why; the node drains"
  exit "$rc"
}

# skip_absent_node: end the script with 0 when the first stage command said the manifest does not
# list this node. Prolog= and Epilog= run on every node of a cluster, also on those that serve no
# model; both once drained such a node (exit 2), and the epilog then "repaired" it. The manifest
# is read whole before the node is looked up, so this error means a valid manifest without this
# node; the command stopped there, before it wrote or read anything else.
skip_absent_node() {
  [ "$rc" -eq 2 ] || return 0
  case $error in
    *": nodes.$STAGE_NODE: no such node "*)
      say "job ${SLURM_JOB_ID:-?} on $STAGE_NODE: not in $STAGE_MANIFEST, nothing to stage"
      exit 0 ;;
  esac
}

# run_stage ARGS...: run stage; $rc is its exit code, $error one line on what went wrong: its
# error line, else (problems found) its summary and first problem, from the report on stdout.
run_stage() {
  local out err
  out=$(mktemp) err=$(mktemp)
  "$STAGE" "$@" >"$out" 2>"$err"
  rc=$?
  error=$(grep -v '^note: ' "$err" | tail -n 1)
  [ -n "$error" ] || error=$(head -n 2 "$out" | sed 's/^ *//; s/  */ /g' | paste -sd '|' - | sed 's/|/; /')
  rm -f "$out" "$err"
}
