"""The layouts (stager/engram/layouts.py): which rows each rank serves, floor and heads."""

from __future__ import annotations

import random

import pytest

from engram_fixtures import build, independent_bounds, pack
from stager.engram.layouts import partition
from stager.base.errors import BadInput

def test_heads_sizes_that_do_not_sum_to_the_rows_exit_2(tmp_path):
    env = build(tmp_path, rows={1: 1_003, 14: 1_003}, layout="heads", manifest_heads=[500, 500], world=2)
    err = pack(env, "--rank", 0, code=2)["stderr"]
    assert "engram_head_rows sum to 1000 but the table has 1003 rows" in err and "layer 1" in err


@pytest.mark.parametrize("rows", [1, 2, 7, 1_003, 384_006_168, 384_016_682, 2 ** 40 + 3])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
def test_floor_ranges_tile_the_table_in_rank_order(rows, world):
    ranges = [partition(rows, world, rank) for rank in range(world)]
    assert ranges == independent_bounds(rows, world)
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_heads_ranges_are_whole_heads_in_rank_order():
    rng = random.Random(7)
    for _ in range(200):
        heads = [rng.randrange(1, 50_000_000) for _ in range(rng.randrange(8, 40))]
        world = rng.choice([1, 2, 3, 4, 8])
        ranges = [partition(sum(heads), world, rank, "heads", heads) for rank in range(world)]
        assert ranges == independent_bounds(sum(heads), world, "heads", heads)
        starts = {0}
        for size in heads:
            starts.add(max(starts) + size)
        assert all(lo in starts and hi in starts for lo, hi in ranges), "a head straddles two ranks"
        assert ranges[0][0] == 0 and ranges[-1][1] == sum(heads)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "the packer's one pass needs rank order"


@pytest.mark.parametrize("args,message", [
    ((10, 3, 3), "rank 3 is outside 0..2 for TP=3"),
    ((10, 2, 0, "heads", [5, 6]), "engram_head_rows sum to 11 but the table has 10 rows"),
    ((10, 3, 0, "heads", [5, 5]), "2 hash heads cannot give each of TP=3 ranks a whole head"),
    ((10, 2, 0, "heads", [5, 0, 5]), "positive integers"),
    ((10, 2, 0, "rows"), "unknown Engram layout 'rows'"),
])
def test_partitions_that_cannot_be_made_are_refused(args, message):
    with pytest.raises(BadInput, match=message):
        partition(*args)
