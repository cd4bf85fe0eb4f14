"""Every shell line the documentation shows is run, or listed here with the reason it is not.

The ```sh blocks of README.md and docs/*.md are parsed by `bash -n`, then run in document order
against the demo NAS (scripts/make_demo_nas.py) with STAGE_MANIFEST set, the installed `stage`
first on PATH, a stand-in `docker` that records its arguments, and `date` faked to a day whose
number bash would read as octal (008): a nightly scrub written as `$(( $(date +%j) % 7 ))`
once failed on those days. Every `$(( ... ))` in the docs, in a block or inline, is evaluated for
every day of the year.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Blocks that need infrastructure the test machine does not have, or that other tests run;
# keyed by (file, the block's first line). Each is still syntax-checked.
NOT_RUN = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/python scripts/make_demo_nas.py "
                  "demo && .venv/bin/stage mirror --node dgx1 --manifest demo/cluster.toml"):
        "the main job: test_cli_contract.py::test_readme_path_is_green_end_to_end runs it, in the venv it made",
    ("README.md", "bash scripts/test.sh"): "the whole suite, this test included",
    ("README.md", "stage --install-completion          # bash: ~/.bash_completions/stage.sh, sourced from ~/.bashrc"):
        "writes the operator's ~/.bashrc; tests/cli/test_completion.py installs into a temporary HOME",
    ("benchmarks.md", "python3 -m venv .venv && .venv/bin/pip install -q .     # the README's set-up"):
        "minutes of benchmark rounds; tests/tools/test_bench.py runs the bench",
    ("fleet.md", "pip install '.[fleet]'             # in the checkout: ray[default]>=2.52, paramiko, fsspec"):
        "installs Ray and its dependencies from the package registry into the environment",
    ("fleet.md", "(umask 077; ray get-auth-token --generate >/dev/null)   # writes ~/.ray/auth_token"):
        "writes the operator's ~/.ray; tests/fleet/test_fleet.py starts token-authenticated Ray clusters",
    ("fleet.md", "# on every node, and for `stage fleet`: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... as above"):
        "starts Ray on the hosts dgx1..dgx3; tests/fleet/test_fleet.py runs real Ray nodes",
    ("fleet.md", "export RAY_ADDRESS=dgx1:6379"): "needs a Ray head at dgx1:6379; tests/fleet/test_fleet.py runs `stage fleet`",
    ("fleet.md", "stage mirror --node dgx2 --source sftp://stage@dgx1/nvme/hf/hub   # once, by hand"):
        "needs sshd on a peer named dgx1; tests/sources/test_remote.py stages from a real sshd peer",
    ("fleet-lab.md", 'STAGE_TEST_FANOUT_MIB=256 pytest -s tests/fleet/test_fleet.py -k "stages_every_node or fan_out"'):
        "a test run of its own",
    ("fleet-lab.md", "python scripts/lab/fleet_lab.py up --nodes 4 --rate 100 --size 48MiB | jq .    # hold a lab until Ctrl-C"):
        "network namespaces held until Ctrl-C; the lab's own tests run scripts/lab/fleet_lab.py",
    ("fleet.md", "# on every node, for the cluster network 10.0.0.0/24 (nftables)"):
        "changes the host's firewall (nftables); the lab's tests open the same ports between namespaces",
    ("operations.md", "install -m 644 scripts/ops/stage-audit.cron /etc/cron.d/stage-audit"):
        "installs into the host's /etc; tests/housekeeping/test_audit.py runs the cron line's command",
    ("operations.md", "install -m 644 scripts/ops/stage-audit.service scripts/ops/stage-audit.timer /etc/systemd/system/"):
        "needs systemd as PID 1; tests/tools/test_slurm.py and test_cli_contract.py check the units",
    ("operations.md", "stage audit --node dgx1                          # what is reclaimable, what is in use, the prune command"):
        "archives /nvme shards to /mnt/archive on the host and runs Ray; tests/housekeeping/test_prune.py prunes real hubs",
    ("operations.md", "mkdir -p /mnt/archive/dgx1-tp2          # DEST must exist (see below)"):
        "writes /nvme and /mnt/archive on the host; tests/housekeeping/test_archive.py runs the same commands on temp paths",
    ("operations.md", "# NFS: attributes may be stale; stage never trusts them (it samples the bytes)."):
        "mounts a NAS; tests/sources/test_sshfs.py mounts a real sshfs with these options",
}

# `date` as the docs call it, with the day of the year faked (a function, exported to subshells).
FAKE_DATE = r"""
date() { if [ "$1" = "+%j" ]; then printf '%s\n' "$STAGE_TEST_DAY"; else command date "$@"; fi; }
export -f date
"""


def sh_blocks() -> list[tuple[str, int, str]]:
    """(file name, line number, text) of every ```sh block, in document order."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
            found.append((doc.name, text[:match.start()].count("\n") + 2, match.group(1)))
    return found


def key(name: str, text: str) -> tuple[str, str]:
    return name, text.splitlines()[0]


def test_every_block_parses_and_the_list_of_blocks_not_run_is_current():
    blocks = sh_blocks()
    assert len(blocks) >= 20, blocks
    for name, line, text in blocks:
        result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, f"{name}:{line}: {result.stderr}"
    stale = set(NOT_RUN) - {key(name, text) for name, _, text in blocks}
    assert not stale, f"listed as not run, but no longer in the docs: {stale}"


@pytest.fixture(scope="module")
def demo_checkout(tmp_path_factory):
    """A checkout as the README leaves it: scripts/, the venv at .venv, the demo NAS, dgx1 mirrored."""
    where = tmp_path_factory.mktemp("docs-shell")
    shutil.copytree(REPO / "scripts", where / "scripts")
    (where / ".venv").symlink_to(BIN.parent)
    subprocess.run([sys.executable, "scripts/make_demo_nas.py", "demo"], cwd=where, check=True, capture_output=True)
    (where / "bin").mkdir()
    (where / "bin" / "docker").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {where / "docker.log"}\n')
    (where / "bin" / "docker").chmod(0o755)
    mirror = subprocess.run([str(BIN / "stage"), "mirror", "--node", "dgx1", "--manifest", "demo/cluster.toml"],
                            cwd=where, capture_output=True, text=True)
    assert mirror.returncode == 0, mirror.stderr
    return where


def test_every_block_runs_on_the_demo(demo_checkout):
    where, day = demo_checkout, "008"
    env = {k: v for k, v in os.environ.items() if k != "STAGE_MANIFEST"}
    env.update(PATH=f"{where / 'bin'}:{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               STAGE_MANIFEST=str(where / "demo" / "cluster.toml"), STAGE_TEST_DAY=day)
    ran = 0
    for name, line, text in sh_blocks():
        if key(name, text) in NOT_RUN:
            continue
        if name == "README.md" and "hubgen.py" in text:
            shutil.rmtree(where / "hubs", ignore_errors=True)  # the block makes new hubs each time
        script = f"{FAKE_DATE}\nset -e -o pipefail\n{text}"
        result = subprocess.run(["bash", "-c", script], cwd=where, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{name}:{line} (day {day}) exit {result.returncode}:\n{text}\n{result.stderr}"
        ran += 1
    assert ran >= 6
    # The container launch got the binds as arguments, staged files read-only.
    assert " -v " in f" {(where / 'docker.log').read_text()}" and ":ro" in (where / "docker.log").read_text()


def arithmetic() -> list[tuple[str, str]]:
    """Every `$(( ... ))` in the docs (a block or an inline span), with the file it is in."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for start in [m.start() for m in re.finditer(r"\$\(\(", text)]:
            depth, end = 0, start + 1
            while end < len(text):  # to the matching parenthesis: the expression holds $(date ...)
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
                if depth == 0:
                    break
            found.append((doc.name, text[start:end]))
    return found


def test_every_arithmetic_line_works_on_every_day_of_the_year():
    expressions = arithmetic()
    assert any("date +%j" in expr for _, expr in expressions), expressions
    for name, expr in expressions:
        script = f'{FAKE_DATE}\nfor d in $(seq -w 1 366); do STAGE_TEST_DAY=$(printf %03d "$((10#$d))"); ' \
                 f'echo "{expr}" || exit 1; done'
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0 and not result.stderr, f"{name}: {expr}: {result.stderr[:300]}"
        values = result.stdout.split()
        assert len(values) == 366, (name, expr, values[:12])
        if "% 7" in expr:
            assert set(values) == {str(n) for n in range(7)}, (name, expr, sorted(set(values)))
