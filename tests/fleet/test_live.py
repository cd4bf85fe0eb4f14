"""The live display's rate: bytes that land in whole chunks, read once a second at any phase of
their landing, never show more than the rate they land at, and a stall shows as a falling rate."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from stager.fleet.live import Tracker
from stager.fleet.report import Progress

MiB = 1024 * 1024
UNITS = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}


def shown_rates(answers: list[Progress]) -> list[float | None]:
    """The rate a one-node display shows at each of these answers of its agent (None: no rate)."""
    drawn: list[list[str]] = []
    tracker = Tracker("mirror", ["dgx1"], show=drawn.append)
    rates = []
    for answer in answers:
        driver = SimpleNamespace(running={}, runs={}, watch=SimpleNamespace(latest={"dgx1": answer}, stalled={}),
                                 pings=SimpleNamespace(nodes=lambda: ()))
        tracker.drawn = 0.0  # draw at every look
        tracker.tick(driver)
        rate = re.search(r" of [\d.]+ \w+  ([\d.]+) (B|KiB|MiB|GiB)/s", drawn[-1][0])
        rates.append(float(rate.group(1)) * UNITS[rate.group(2)] if rate else None)
    return rates


def chunked(rate: float, offset: float, looks: int, chunk: int = MiB, stall_after: float | None = None):
    """An agent receiving 1 MiB chunks at `rate`, its first landing at `offset`, asked once a second
    (its answers a little late or early), the chunks stopping at `stall_after`."""
    every = chunk / rate
    answers = []
    for look in range(looks):
        read_at = 100.0 + look + (0.07 if look % 3 == 1 else 0.0)
        last_landing = min(read_at, stall_after if stall_after is not None else read_at)
        landed = int((last_landing - 100.0 - offset) // every) + 1 if last_landing >= 100.0 + offset else 0
        grew_at = 100.0 + offset + (landed - 1) * every if landed else None
        answers.append(Progress("broadcast", done_bytes=landed * chunk, total_bytes=64 * MiB, source="nas",
                                session=0, read_at=read_at, grew_at=grew_at))
    return answers


@pytest.mark.parametrize("offset", [0.0, 0.01, 0.2, 0.49, 0.51, 0.99])
def test_whole_chunks_read_at_any_phase_never_show_more_than_they_land_at(offset):
    rate = 2 * MiB
    rates = shown_rates(chunked(rate, offset, looks=12))
    assert rates[0] is None and None not in rates[3:], rates  # from a second after the first count seen on
    shown = [r / MiB for r in rates[3:]]
    assert max(shown) <= 2.0001 and shown[-1] >= 1.8, shown


def test_a_stall_shows_as_a_falling_rate_and_answers_without_growth_show_none():
    rate = 4 * MiB
    shown = [r / MiB for r in shown_rates(chunked(rate, 0.1, looks=14, stall_after=106.0))[2:]]
    assert 3.0 <= shown[4] <= 4.0001, shown  # at 106 s, as the chunks stop
    after = shown[5:]
    assert after == sorted(after, reverse=True) and after[-1] == 0, shown
    waiting = [Progress("broadcast", total_bytes=MiB, source="nas", session=0, read_at=100.0 + t) for t in range(5)]
    assert shown_rates(waiting) == [None] * 5
