"""The agent's answer has the node-local command's shape and contract (exit codes, JSON, one
error line, "timed out" at its budget), whatever the command did. The agent on real Ray nodes is
exercised by tests/fleet/test_fleet.py and tests/fleet/test_fleet_lab.py."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
import time

from stager.base.errors import BadInput, CannotRun
from stager.fleet.agent import _answer
from stager.mirror.hub import Problem
from stager.mirror.pipeline import MirrorReport


def test_a_clean_report_is_exit_0_and_its_json():
    answer = _answer(lambda: MirrorReport(copied_files=2, copied_bytes=10, source="/nas"), 5)
    assert (answer["code"], answer["stderr"], answer["timed_out"]) == (0, "", False)
    assert json.loads(answer["stdout"]) == MirrorReport(copied_files=2, copied_bytes=10, source="/nas").to_json()


def test_problems_are_exit_1():
    report = MirrorReport(problems=[Problem("/nvme/hub/x", "mismatch", "sampled xxh3-128 differs")])
    answer = _answer(lambda: report, 5)
    assert answer["code"] == 1 and json.loads(answer["stdout"])["problems"][0]["path"] == "/nvme/hub/x"


def test_errors_keep_their_exit_code_and_one_line():
    def raising(exc):
        def command():
            raise exc
        return command

    eio = OSError(errno.EIO, "Input/output error", "/nvme/hub/blobs/ab")
    for exc, code, named in ((BadInput("m.toml: nodes.dgx1.hub: not absolute"), 2, "m.toml"),
                             (CannotRun("lock held"), 3, "lock held"), (eio, 3, "/nvme/hub/blobs/ab"),
                             (RuntimeError("boom"), 3, "boom")):
        answer = _answer(raising(exc), 5)
        assert answer["code"] == code, (exc, answer)
        lines = answer["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith("stage: ") and named in lines[0], answer
        assert json.loads(answer["stdout"])["exit_code"] == code


def test_a_command_past_its_budget_is_timed_out_at_the_budget():
    release = threading.Event()
    started = time.monotonic()
    answer = _answer(lambda: release.wait(30) and MirrorReport(), 0.3)
    release.set()
    assert answer["timed_out"] and answer["code"] is None
    assert 0.3 <= answer["seconds"] < 5 and time.monotonic() - started < 5


def test_a_nodes_actors_load_none_of_the_drivers_modules():
    """A node's Ray worker imports its actor's module by name (agent, node); the package's
    `__init__` once loaded the driver and the CLI's rooms with it, for every node at its start."""
    driver_only = ("stager.fleet.driver", "stager.fleet.live", "stager.fleet.choice", "stager.fleet.sftp_tree",
                   "stager.cli")
    for module in ("stager.fleet.node", "stager.fleet.agent"):
        loaded = subprocess.run(
            [sys.executable, "-c", f"import sys, {module}; print(' '.join(sorted(sys.modules)))"],
            capture_output=True, text=True, check=True, timeout=60).stdout.split()
        assert module in loaded
        assert [name for name in driver_only if name in loaded] == [], (module, loaded)
