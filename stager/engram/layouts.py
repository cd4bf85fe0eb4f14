"""The layouts: which rows each tensor-parallel rank serves, a pure function of the rows and the layout.

For both layouts the ranks' ranges tile [0, rows) in rank order, each one contiguous, so the
ranges of any set of ranks, taken in rank order, are met in one sequential pass over the table.
The packer relies on that to read a table once for all of a node's ranks.
"""

from __future__ import annotations

from stager.base.errors import BadInput

LAYOUTS = ("floor", "heads")


def partition(rows: int, world: int, rank: int, layout: str = "floor",
              head_rows: tuple[int, ...] | list[int] | None = None) -> tuple[int, int]:
    """Rows [lo, hi) served by `rank` of `world`.

    floor: lo = rows*R//TP, hi = rows*(R+1)//TP, the split the serving engine computes.
    heads: whole hash heads per rank; rank R gets heads H*R//TP .. H*(R+1)//TP - 1 of
    the H heads (sizes in `head_rows`, summing to `rows`), so no head straddles two ranks.
    """
    if not 0 <= rank < world:
        raise BadInput(f"rank {rank} is outside 0..{world - 1} for TP={world}")
    if layout == "floor":
        return rows * rank // world, rows * (rank + 1) // world
    if layout != "heads":
        raise BadInput(f"unknown Engram layout {layout!r} (expected floor or heads)")
    heads = list(head_rows or ())
    if not heads or any(not isinstance(h, int) or isinstance(h, bool) or h <= 0 for h in heads):
        raise BadInput(f"layout heads needs engram_head_rows as positive integers, got {head_rows!r}")
    if sum(heads) != rows:
        raise BadInput(f"engram_head_rows sum to {sum(heads)} but the table has {rows} rows")
    if len(heads) < world:
        raise BadInput(f"{len(heads)} hash heads cannot give each of TP={world} ranks a whole head")
    first, last = len(heads) * rank // world, len(heads) * (rank + 1) // world
    lo = sum(heads[:first])
    return lo, lo + sum(heads[first:last])
