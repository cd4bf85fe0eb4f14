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
  # Two workers for all but the namespace lab (tests/conftest.py groups them), then the lab
  # alone: its tests compare wall times, which another worker's load would skew.
  lab=tests/fleet/test_fleet_lab.py
  "${pytest[@]}" -n 2 --dist loadscope --basetemp "$base/t" --ignore "$lab" || status=$?
  "${pytest[@]}" --basetemp "$base/lab" "$lab" || status=$?
fi
rm -rf --one-file-system "$base"
exit "$status"
