#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: system tools (as root), a venv, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

needed=(rsync rclone sshfs openssh-server b3sum time fuse3 util-linux coreutils jq prometheus)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for pkg in "${needed[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test,fleet]'
# The package's bytecode, as a non-editable install has it: under PYTHONDONTWRITEBYTECODE every
# `stage` process the suite starts would compile each module again.
.venv/bin/python -m compileall -q stager >/dev/null
# A temp root of this run's own: another pytest on the machine never cleans it away under us,
# and nothing of it outlives the run.
base=$(mktemp -d "${TMPDIR:-/tmp}/stager-tests.XXXXXX")
status=0
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25)
if [ $# -gt 0 ]; then
  "${pytest[@]}" --basetemp "$base/t" "$@" || status=$?
else
  # The tests that time real work against fixed bounds (the namespace lab's transports, a
  # --bwlimit copy's seconds) run in one pytest; the others on two xdist workers (tests/conftest.py
  # groups them). The timed ones mostly wait (on the lab's shaped links, on the rate) and the
  # others are CPU-bound, so as root the others run beside them in a cgroup v1 cpu group with half
  # their share of the CPU (cpu.shares; nice would not hold for the processes the tests start in
  # sessions of their own, each in an autogroup of its own), and take what the timed ones leave.
  # The timed ones' report is printed first. Without that group, they run alone after the others.
  timed_modules=(tests/fleet/test_fleet_lab.py tests/cli/test_bwlimit.py)
  timed=("${pytest[@]}" --basetemp "$base/timed" "${timed_modules[@]}")
  rest=("${pytest[@]}" -n 2 --dist loadscope --basetemp "$base/t")
  for module in "${timed_modules[@]}"; do rest+=(--ignore "$module"); done
  group=/sys/fs/cgroup/cpu/stager-tests-$$
  if [ "$(id -u)" = 0 ] && mkdir "$group" 2>/dev/null && echo 512 > "$group/cpu.shares"; then
    (echo "$BASHPID" > "$group/cgroup.procs" && exec "${rest[@]}") > "$base/rest.log" 2>&1 &
    others=$!
    "${timed[@]}" || status=$?
    wait "$others" || status=$?
    cat "$base/rest.log"
    rmdir "$group" 2>/dev/null || true
  else
    rmdir "$group" 2>/dev/null || true
    "${rest[@]}" || status=$?
    "${timed[@]}" || status=$?
  fi
fi
rm -rf --one-file-system "$base"
exit "$status"
