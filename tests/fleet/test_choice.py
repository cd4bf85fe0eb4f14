"""The driver's choice per group of files, between the broadcast and direct reads (fleet/choice.py):
by the rates, as measured or as the manifest's [fleet] keys tell them. The choice made on a real
cluster, measured, is tests/fleet/test_fleet_lab.py's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fake_ray import Call, FakeRay, QuietWatch
from stager.base.errors import BadInput
from stager.fleet.broadcast.relay import Share
from stager.fleet.choice import Probes, Rates, choose
from stager.fleet.report import FleetReport, table
from stager.manifest import FleetConfig, read_manifest

MB = 1_000_000
NODES = ("dgx1", "dgx2", "dgx3", "dgx4")
GROUP = [(NODES, tuple(Share(f"blobs/{i}", f"models--m/blobs/{i}", 500 * MB) for i in range(4)))]


def test_on_the_usual_cluster_the_nas_is_no_faster_than_a_link_and_the_broadcast_is_chosen():
    """One NAS uplink like each node's: read alone it gives a node what a link does, and read by
    every node at once a quarter of it each."""
    rates = Rates(nas_alone=25 * MB, nas_each={name: 6.25 * MB for name in NODES},
                  link={name: 25 * MB for name in NODES}, cpu={name: 400 * MB for name in NODES})
    [chosen] = choose(GROUP, rates)
    assert chosen.transport == "broadcast"
    assert chosen.seconds["broadcast"] == pytest.approx(2000 / 25, rel=0.01) and chosen.seconds["nas"] == 320
    # Without a direct rate (the NAS alone was no faster than the links: not measured), the broadcast.
    assert choose(GROUP, Rates(nas_alone=25 * MB, link={name: 25 * MB for name in NODES}))[0].transport == "broadcast"


def test_a_nas_faster_than_the_links_flips_the_choice_to_direct_reads():
    rates = Rates(nas_alone=2000 * MB, nas_each={name: 600 * MB for name in NODES},
                  link={name: 25 * MB for name in NODES})
    [chosen] = choose(GROUP, rates)
    assert chosen.transport == "nas" and chosen.seconds["nas"] < chosen.seconds["broadcast"]
    assert "reads the NAS at" in chosen.limit and "with 4 reading" in chosen.limit


def test_a_relay_held_back_by_its_cpu_loses_to_direct_reads_its_links_would_not():
    fast_links = {name: 1200 * MB for name in NODES}
    each = {name: 300 * MB for name in NODES}
    assert choose(GROUP, Rates(nas_alone=900 * MB, nas_each=each, link=fast_links))[0].transport == "broadcast"
    starved = {**{name: 1000 * MB for name in NODES}, "dgx3": 60 * MB}
    [chosen] = choose(GROUP, Rates(nas_alone=900 * MB, nas_each=each, link=fast_links, cpu=starved))
    assert chosen.transport == "nas" and chosen.seconds["broadcast"] == pytest.approx(2000 / 60, rel=0.01)


def test_the_manifest_tells_the_rates_and_nothing_is_measured():
    """All three [fleet] keys: the driver asks no node anything (no agents are even given)."""
    told = FleetConfig(nas_rate=8000 * MB, nas_node_rate=3000 * MB, relay_rate=3000 * MB)
    probes = Probes(None, dict.fromkeys(NODES), None, told)
    rates = probes.rates(GROUP)
    assert rates.nas_alone == 3000 * MB and rates.nas_each == dict.fromkeys(NODES, 2000 * MB)
    assert rates.link == dict.fromkeys(NODES, 3000 * MB) and rates.cpu == {}
    assert rates.told == ("nas_rate", "nas_node_rate", "relay_rate")
    assert choose(GROUP, rates)[0].transport == "broadcast"  # 4 nodes share 8 GB/s: 2 GB/s each, below 3
    slower = Probes(None, dict.fromkeys(NODES), None, FleetConfig(nas_rate=16000 * MB, nas_node_rate=3000 * MB,
                                                                  relay_rate=1000 * MB)).rates(GROUP)
    assert choose(GROUP, slower)[0].transport == "nas"


def test_the_links_the_chain_judges_its_head_by_are_no_faster_than_the_bwlimit():
    """--bwlimit caps every relay's sends: a link carries no more, whatever its pull measured. A
    head reading the NAS at a 2 MiB/s --bwlimit is the chain's pace, not a third of a loopback's."""
    told = FleetConfig(relay_rate=3000 * MB)
    assert Probes(None, dict.fromkeys(NODES), None, told).known_links() == dict.fromkeys(NODES, 3000 * MB)
    capped = Probes(None, dict.fromkeys(NODES), None, told, bwlimit=2 * 1024 * 1024).known_links()
    assert capped == dict.fromkeys(NODES, 2 * 1024 * 1024)


def test_under_a_bwlimit_below_the_links_a_fast_nas_keeps_the_broadcast():
    """--bwlimit caps each node's NAS reads and each relay's sends: on a NAS faster than the links
    direct reads win uncapped, but at a cap below the links both move at the cap, and direct reads
    would read the NAS at N times it for nothing. Above the links the cap masks no real win."""
    fast = dict(nas_alone=2000 * MB, nas_each={name: 600 * MB for name in NODES}, link={name: 25 * MB for name in NODES})
    [capped] = choose(GROUP, Rates(**fast, bwlimit=10 * MB))
    assert capped.transport == "broadcast" and capped.limit == "--bwlimit caps every node at 9.54 MiB/s", capped
    assert capped.seconds["nas"] == pytest.approx(2000 / 10) and capped.seconds["broadcast"] > capped.seconds["nas"]
    [above] = choose(GROUP, Rates(**fast, bwlimit=100 * MB))
    assert above.transport == "nas" and above.seconds["nas"] == pytest.approx(2000 / 100), above
    assert above.limit.startswith("each node reads the NAS at 95.37 MiB/s (--bwlimit) with 4 reading"), above.limit


def test_within_the_chains_fill_of_direct_reads_the_broadcast_is_chosen():
    """Direct reads as fast as the chain's slowest hop finish a chunk's time per hop sooner, and
    read the NAS four times: the broadcast. A little faster than that, direct reads."""
    even = Rates(nas_alone=100 * MB, nas_each={name: 25 * MB for name in NODES}, link={name: 25 * MB for name in NODES})
    [chosen] = choose(GROUP, even)
    assert chosen.transport == "broadcast" and chosen.seconds["nas"] < chosen.seconds["broadcast"], chosen
    ahead = Rates(nas_alone=100 * MB, nas_each={name: 26 * MB for name in NODES}, link={name: 25 * MB for name in NODES})
    assert choose(GROUP, ahead)[0].transport == "nas"


def test_under_a_bwlimit_below_the_links_no_node_reads_the_nas_to_measure_direct_reads():
    """The head reads a NAS far faster than the links, but no node may read it faster than the
    cap, which is below the links: direct reads cannot win, and no node reads 2 % of the data
    to measure them."""
    asked: list[str] = []
    agents = {name: _agent(nas=2000 * MB, ceiling=1200 * MB, link=25.0 * MB, asked=asked) for name in NODES}
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig(), bwlimit=10 * MB).rates(GROUP)
    assert asked.count("nas") == 1 and rates.nas_each == {} and rates.bwlimit == 10 * MB, (asked, rates)
    assert choose(GROUP, rates)[0].transport == "broadcast"
    asked.clear()
    uncapped = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert asked.count("nas") == 1 + len(NODES) and choose(GROUP, uncapped)[0].transport == "nas", asked


def _agent(nas: float, ceiling: float, link: float | None = None, asked: list | None = None,
           nas_alone: float | None = None, so_far: tuple = ()) -> SimpleNamespace:
    """A node whose NAS reads at `nas` (`nas_alone` the first time, if given: the head reading it
    alone), whose cores could carry a relay at `ceiling`, and whose pull of the link probe ends at
    `link` (None: never, a link too slow to have measured anything yet); while it runs, each look
    at it gives the next of `so_far` (then the last), else nothing. Every measure it is asked for
    goes to `asked`."""
    asked = [] if asked is None else asked
    reads = iter([nas_alone] if nas_alone else [])
    looks = iter(so_far)
    last = so_far[-1] if so_far else None

    def call(name: str, value, ready: bool = True) -> SimpleNamespace:
        def remote(*args) -> Call:
            asked.append(name)
            return Call(value() if callable(value) else value, ready=ready)

        return SimpleNamespace(remote=remote)

    return SimpleNamespace(probe_payload=call("payload", b""), probe_pull=call("pull", link, ready=link is not None),
                           probe_pulled=call("pulled", lambda: next(looks, last)), probe_nas=call("nas", lambda: (next(reads, nas), ceiling)),
                           probe_cpu=call("cpu", ceiling))


def test_a_nas_faster_than_what_the_heads_cores_could_relay_is_read_by_every_node_without_waiting_for_the_links():
    """The head's ceiling bounds every hop of the chain from above: a NAS 1.5x faster than it goes
    to every node's measure at once. It once waited for the links' pulls too (half a second on the
    lab's links, on runs direct reads take in two; here, a pull that never ends, PROBE_WAIT)."""
    agents = {name: _agent(nas=2000 * MB, ceiling=1200 * MB) for name in NODES}
    started = time.monotonic()
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert time.monotonic() - started < 1.0
    assert rates.nas_each == dict.fromkeys(NODES, 2000 * MB) and rates.link == {}, rates
    assert choose(GROUP, rates)[0].transport == "nas"


def test_once_the_links_show_direct_reads_win_no_cpu_is_measured():
    """Direct reads at 800 MB/s against a chain the head's cores would let run at 1.2 GB/s (its NAS
    read alone at 2 GB/s): the broadcast could win until the links are in (25 MB/s). Then it
    cannot, whatever the CPU: no node spends 0.2 s hashing for a measure that cannot change the
    choice."""
    asked: list[str] = []
    agents = {name: _agent(nas=800 * MB, nas_alone=2000 * MB, ceiling=1200 * MB, link=25.0 * MB, asked=asked)
              for name in NODES}
    probes = Probes(FakeRay(), agents, QuietWatch(), FleetConfig())
    rates = probes.rates(GROUP)
    assert "cpu" not in asked and rates.cpu == {} and rates.link == dict.fromkeys(NODES[1:], 25.0 * MB), (asked, rates)
    assert choose(GROUP, rates)[0].transport == "nas"


def test_the_link_into_the_head_is_no_hop_the_head_pulls_nothing_and_sends_no_node_to_the_nas():
    """The usual cluster: the NAS alone gives the head what a link gives a node. The head once
    pulled from the last node (a ring) and its pull came in slow, as 8 agents starting on the lab's
    2 cores made it: it counted as the chain's slowest hop, so every node read 2 % of the data from
    the NAS to measure direct reads that could not win. Now the head pulls nothing (on the 2-node
    lab its pull held the next node's first piece back 250 ms), and the last node, which no node
    pulls from, makes no payload."""
    asked = {name: [] for name in NODES}
    agents = {name: _agent(nas=6 * MB, nas_alone=24 * MB, ceiling=1200 * MB, link=25.0 * MB, asked=asked[name])
              for name in NODES}
    agents["dgx1"] = _agent(nas=6 * MB, nas_alone=24 * MB, ceiling=1200 * MB, link=14.0 * MB, asked=asked["dgx1"])
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert "pull" not in asked["dgx1"] and all("pull" in asked[name] for name in NODES[1:]), asked
    assert "payload" not in asked[NODES[-1]] and all("payload" in asked[name] for name in NODES[:-1]), asked
    assert sum(calls.count("nas") for calls in asked.values()) == 1 and rates.nas_each == {}, (asked, rates)
    assert rates.link == dict.fromkeys(NODES[1:], 25.0 * MB)
    assert choose(GROUP, rates)[0].transport == "broadcast"


def test_told_the_transport_no_node_pulls_from_the_head():
    """Told the transport, the links only judge the chain's head (chain._Route._slow_head), by the
    links between the other nodes: the pull out of the head is not taken. On the lab it filled a
    slow head's uplink for 2 s just as the head began reading the NAS."""
    asked = {name: [] for name in NODES}
    agents = {name: _agent(nas=6 * MB, ceiling=1200 * MB, link=25.0 * MB, asked=asked[name]) for name in NODES}
    probes = Probes(FakeRay(), agents, QuietWatch(), FleetConfig(), choosing=False)
    assert "payload" not in asked["dgx1"] and "pull" not in asked[NODES[1]], asked
    assert all("pull" in asked[name] for name in NODES[2:]), asked
    assert probes.known_links() == dict.fromkeys(NODES[2:], 25.0 * MB)


def test_one_link_measured_slow_sends_no_node_to_the_nas_on_a_usual_cluster():
    """The lab's 100 Mbit/s links (12.5 MB/s), one measured at 8.4 while the agents started on 2
    cores, the others at 12.5 and 14.9; the head read the NAS at 13.0 (CI). Against the slowest
    link the NAS looked 1.55x faster and every node read 2 % of the data from it; against the
    links' median it is no faster than the chain. A slow link's node is the laggard rule's."""
    asked = {name: [] for name in NODES}
    links = dict(zip(NODES, (12.5 * MB, 8.4 * MB, 14.9 * MB, 12.5 * MB)))
    agents = {name: _agent(nas=4 * MB, nas_alone=13.0 * MB, ceiling=1200 * MB, link=links[name], asked=asked[name])
              for name in NODES}
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert sum(calls.count("nas") for calls in asked.values()) == 1 and rates.nas_each == {}, (asked, rates)
    assert choose(GROUP, rates)[0].transport == "broadcast"


def test_a_nas_far_faster_than_the_links_so_far_is_read_by_every_node_once_the_second_piece_is_in():
    """The head's read of a fast NAS came out under 1.5x its cores' ceiling (an uncached read of a
    few MB is noisy), so the links decide; at the first look no pull had its second piece in. It
    once waited for every piece of every pull (0.43 s on the lab); here the pulls never end, and
    the second look, with a rate so far 60 times under the NAS, is enough."""
    agents = {name: _agent(nas=1500 * MB, ceiling=1200 * MB, so_far=(None, 25.0 * MB)) for name in NODES}
    started = time.monotonic()
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert time.monotonic() - started < 1.0
    assert rates.nas_each == dict.fromkeys(NODES, 1500 * MB), rates


def test_direct_reads_far_ahead_of_the_links_so_far_are_chosen_without_waiting_for_the_pulls_to_end():
    """Every node reads the NAS at 800 MB/s; the head's cores could relay 1.2 GB/s, so the broadcast
    could win until a link shows. The choice once looked at the links once, before any pull had its
    second piece in, then waited for every piece (0.19 s of a 2.8 s run on the 2-node fast-NAS lab;
    here the pulls never end: PROBE_WAIT). It now looks while they run: 25 MB/s so far, even taken
    3 times over, leaves direct reads far ahead."""
    asked: list[str] = []
    agents = {name: _agent(nas=800 * MB, nas_alone=2000 * MB, ceiling=1200 * MB, asked=asked, so_far=(None, 25.0 * MB))
              for name in NODES}
    started = time.monotonic()
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert time.monotonic() - started < 1.0
    assert "cpu" not in asked and rates.link == dict.fromkeys(NODES[1:], 25.0 * MB), (asked, rates)
    assert choose(GROUP, rates)[0].transport == "nas"


def test_links_so_far_only_a_little_behind_direct_reads_wait_for_the_pulls_to_end():
    """Direct reads at 60 MB/s a node; the links' pulls show 25 MB/s after their first pieces (a pull
    is slow to start) and end at 100 MB/s. A rough rate decides only by HASTE_MARGIN: taken at its
    word, the first look once sent every node to the NAS where the chain is faster."""
    agents = {name: _agent(nas=60 * MB, nas_alone=2000 * MB, ceiling=1200 * MB, link=100.0 * MB, so_far=(25.0 * MB,))
              for name in NODES}
    rates = Probes(FakeRay(), agents, QuietWatch(), FleetConfig()).rates(GROUP)
    assert rates.link == dict.fromkeys(NODES[1:], 100.0 * MB), rates
    assert choose(GROUP, rates)[0].transport == "broadcast"


def test_the_table_and_the_json_say_what_was_chosen_and_the_rates_behind_it():
    from stager.fleet.choice import Choice

    rates = Rates(nas_alone=2000 * MB, nas_each=dict.fromkeys(NODES, 600 * MB), link=dict.fromkeys(NODES, 25 * MB))
    choice = Choice(tuple(choose(GROUP, rates)), rates)
    report = FleetReport("mirror", (), 1.0, False, "head:6379", transport=choice.transport, choice=choice)
    shown = report.to_json()
    assert shown["transport"] == "nas"
    assert shown["choice"]["groups"] == [{"nodes": list(NODES), "files": 4, "bytes": 2000 * MB, "transport": "nas",
                                          "seconds": {"broadcast": 80.13, "nas": 3.33},
                                          "limit": "each node reads the NAS at 572.20 MiB/s with 4 reading "
                                                   "(dgx1 the slowest)"}]
    assert shown["choice"]["rates"]["link"] == dict.fromkeys(NODES, 25 * MB) and shown["choice"]["rates"]["bwlimit"] is None
    capped = Rates(nas_alone=2000 * MB, nas_each=dict.fromkeys(NODES, 600 * MB), link=dict.fromkeys(NODES, 25 * MB),
                   bwlimit=10 * MB)
    assert Choice(tuple(choose(GROUP, capped)), capped).to_json()["rates"]["bwlimit"] == 10 * MB
    lines = table(report)
    assert any(line.startswith("transport: direct reads for 4 files (1.86 GiB) on dgx1, dgx2, dgx3, dgx4: "
                               "3.3s against 80.1s predicted") for line in lines), lines


@pytest.mark.parametrize("key", ["nas_rate", "nas_node_rate", "relay_rate"])
@pytest.mark.parametrize("value", ["off", "0", "fast", "25Gbit", 1000000000, 2.5, True])
def test_a_fleet_rate_that_is_not_one_exits_2_naming_the_key(key, value):
    with pytest.raises(BadInput, match=rf"/m.toml: fleet\.{key}: expected bytes per second in quotes, such as '10GB'"):
        read_manifest({"nas": {"hub": "/nas"}, "fleet": {key: value}}, "/m.toml")
    with pytest.raises(BadInput, match=r"fleet\.speed: unknown key"):
        read_manifest({"nas": {"hub": "/nas"}, "fleet": {"speed": "1G"}}, "/m.toml")
