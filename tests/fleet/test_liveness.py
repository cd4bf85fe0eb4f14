"""liveness.Watch against real Ray actors on a one-node Ray started for the test: an actor whose
worker process is stopped with SIGSTOP goes silent, then stalled, with its last answer; a healthy
one never does, even when the driver pauses between looks for longer than both bounds (the lab once
took such a pause for silence and moved five healthy nodes). Run in a subprocess of its own, on
loopback, so that no other test's Ray settings reach it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import RAY_LOOPBACK

# Found, not imported: Ray reads its settings once per process, and this one runs other clusters.
if importlib.util.find_spec("ray") is None:
    pytest.skip("needs ray", allow_module_level=True)

SCENARIO = r"""
import json, os, signal, sys, time
import ray
from stager.fleet.liveness import Watch
from stager.fleet.report import Progress

SILENCE, SHORT, PAUSE = 4.0, 2.0, 6.0


class Agent:
    def __init__(self):
        self.looks = 0

    def pid(self):
        return os.getpid()

    def progress(self):
        self.looks += 1
        return Progress("broadcast", done_bytes=self.looks, total_bytes=100)


def looking(watch, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.look()
        time.sleep(0.1)


ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
actor = ray.remote(num_cpus=0, max_concurrency=4)(Agent)
agents = {"healthy": actor.remote(), "frozen": actor.remote()}
pids = {name: ray.get(agent.pid.remote()) for name, agent in agents.items()}
watch = Watch(ray, agents, silence=SILENCE, start=30.0)
out = {}
looking(watch, 2.0)
time.sleep(PAUSE)  # the driver busy elsewhere: no look, no call asked
watch.look()
out["after_pause"] = {"silent": sorted(watch.silent_for(SHORT)), "stalled": sorted(watch.stalled)}
looking(watch, 1.5)
answered = watch.latest["frozen"].done_bytes
os.kill(pids["frozen"], signal.SIGSTOP)
stopped = time.monotonic()
try:
    while "frozen" not in watch.stalled and time.monotonic() - stopped < 20:
        watch.look()
        if "frozen" in watch.silent_for(SHORT):
            out.setdefault("silent_after", time.monotonic() - stopped)
        time.sleep(0.05)
    out["stalled_after"] = time.monotonic() - stopped
finally:
    os.kill(pids["frozen"], signal.SIGCONT)
stall = watch.stalled.get("frozen")
out["stalled"] = sorted(watch.stalled)
out["silent_now"] = sorted(watch.silent_for(SHORT))
out["last_held"] = stall.last.done_bytes if stall and stall.last else None
out["answered_before_stop"] = answered
print(json.dumps(out))
ray.shutdown()
"""


def test_a_stopped_agent_is_silent_then_stalled_and_a_pause_between_looks_is_no_silence(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
           **RAY_LOOPBACK,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # Ray's session directory holds unix sockets: a short path.
    short = Path(f"/tmp/stliv-{os.getpid()}")
    short.mkdir(exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-c", SCENARIO, str(short)], env=env, capture_output=True,
                              text=True, timeout=180)
    finally:
        subprocess.run(["rm", "-rf", str(short)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # A pause of 6 s between looks, longer than both bounds: nobody answered late, nobody is silent.
    assert out["after_pause"] == {"silent": [], "stalled": []}, out
    # Stopped: silent within the short bound (plus a look), stalled within SILENCE (plus a look),
    # never before SILENCE less the look it may have missed; the healthy one, never.
    assert 2.0 - 1.0 <= out["silent_after"] <= 2.0 + 1.5, out
    assert 4.0 - 1.0 <= out["stalled_after"] <= 4.0 + 1.5, out
    assert out["stalled"] == ["frozen"] and out["silent_now"] == [], out
    # Its last answer is what it held when it stopped (one look at most before the stop).
    assert out["answered_before_stop"] - 1 <= out["last_held"] <= out["answered_before_stop"] + 1, out


class _RayError(Exception):
    """Ray's own errors (ray.exceptions.RayError), as a fake Ray raises them."""


class _TaskError(_RayError):
    """An error the called method raised (RayTaskError)."""


class _ActorError(_RayError):
    """The actor died (RayActorError)."""


class _Failing:
    """A fake Ray whose every call is done at once and fails: for agent a with an error of its own
    code, for agent b with Ray's word that the call could not reach it (an object lost with its node)."""

    exceptions = SimpleNamespace(RayError=_RayError, RayTaskError=_TaskError, RayActorError=_ActorError)

    def wait(self, refs, num_returns, timeout):
        return list(refs), []

    def get(self, ref):
        raise _TaskError("progress() failed") if ref == "a" else _RayError("the object was lost with its node")


def test_a_call_ray_fails_is_a_death_and_one_the_agent_fails_is_an_answer():
    """An agent whose progress() raised answered: it runs, and is not silent. A call Ray itself
    failed (not the agent) was never answered: the agent is taken for dead and watched no more,
    and its death path (the failed run) reports it. Taken for an answer, a gone node kept looking alive."""
    from stager.fleet.liveness import Watch

    agents = {name: SimpleNamespace(progress=SimpleNamespace(remote=lambda name=name: name)) for name in "ab"}
    watch = Watch(_Failing(), agents)
    watch.look()  # asks both
    watch.looks[-1] -= 2.0  # the next look asks again
    watch.look()  # takes both answers
    assert watch.answered == {"a": 0} and "a" in watch.agents
    assert "b" not in watch.agents and not watch.stalled


class _Backwards:
    """A fake Ray whose calls come back last asked, first in."""

    exceptions = _Failing.exceptions

    def wait(self, refs, num_returns, timeout):
        return list(reversed(refs)), []

    def get(self, ref):
        return f"plan of {ref}"


def test_answers_keep_the_order_asked_not_the_order_they_came():
    """The plans' order is the chain's (manifest order, head first): a run whose dgx2 planned
    first once made dgx2 the head of a chain over dgx2, dgx3, dgx1."""
    from stager.fleet.liveness import Watch, gather

    ray = _Backwards()
    answers = gather(ray, {"dgx1": "dgx1", "dgx2": "dgx2", "dgx3": "dgx3"}, Watch(ray, {}), time.monotonic() + 5)
    assert list(answers.items()) == [("dgx1", "plan of dgx1"), ("dgx2", "plan of dgx2"), ("dgx3", "plan of dgx3")]


def test_a_label_two_live_ray_nodes_claim_is_pinned_to_the_one_whose_raylet_answers():
    """A node that came back (a restarted raylet, a rebooted host) while the GCS still counts its
    old incarnation alive: two live Ray nodes carry its label. Scheduled by label, an agent landed
    on the old one and never ran (the lab's first run after a rejoin, 1.75x). The raylets are real
    sockets here: the new one listens, the old one's port is closed."""
    import socket

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stager.fleet.liveness import placements
    from stager.fleet.node import LABEL

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()

    def node(node_id: str, label: str, port: int, alive: bool = True) -> dict:
        return {"NodeID": node_id, "Alive": alive, "Labels": {LABEL: label}, "NodeManagerAddress": "127.0.0.1",
                "NodeManagerPort": port}

    old, new = "a" * 56, "b" * 56  # Ray's node ids: 28 bytes in hex
    nodes = [node(old, "dgx4", closed_port), node(new, "dgx4", listening.getsockname()[1]),
             node("c" * 56, "dgx1", closed_port), node("d" * 56, "dgx2", closed_port, alive=False)]
    try:
        placed = placements(SimpleNamespace(nodes=lambda: nodes))
    finally:
        listening.close()
    assert set(placed) == {"dgx4", "dgx1"}  # a dead Ray node places nothing
    strategy = placed["dgx4"]["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy) and strategy.node_id == new and not strategy.soft
    # One Ray node for a label: by its label, as ever, and its raylet is not asked.
    assert placed["dgx1"] == {"label_selector": {LABEL: "dgx1"}}
    # Neither of two answers (or both do): by label, as before.
    both_closed = [node(old, "dgx4", closed_port), node(new, "dgx4", closed_port)]
    assert placements(SimpleNamespace(nodes=lambda: both_closed))["dgx4"] == {"label_selector": {LABEL: "dgx4"}}
