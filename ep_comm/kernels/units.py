"""How work is cut: ``num_units`` contiguous item ranges, each walked by one warp, ``32 // K`` items at a time.

Counting and scattering kernels use the same cut, so per-unit counts scanned over units are where
each unit's items start inside each bucket: this is what makes the stable (deterministic) order
a scan rather than a sort. Row-streaming kernels cut each row into pieces instead (:func:`row_piece`),
so that a few long rows still spread over many warps.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.warp import FULL_MASK, WARP


def units_for(num_items: int, items_per_unit: int, max_units: int) -> int:
    """How many units cut ``num_items``: about ``items_per_unit`` each, at least 1, at most ``max_units``."""
    return max(1, min(max_units, quotient32(num_items + items_per_unit - 1, items_per_unit)))


units_for_device = cuda.jit(device=True)(units_for)


@cuda.jit(device=True)
def unit_range(unit, num_units, num_items):
    """``[begin, end)`` items of ``unit`` when ``num_items`` are cut into ``num_units`` even chunks."""
    per_unit = quotient32(num_items + num_units - 1, num_units)
    begin = min(unit * per_unit, num_items)
    return begin, min(begin + per_unit, num_items)


@cuda.jit(device=True)
def row_piece(item, pieces, span, n):
    """Row and ``[begin, end)`` of work item ``item`` when each row's ``n`` indices (elements or words) are
    cut into ``pieces`` pieces of ``span``, item ``row * pieces + piece``: how row work is cut by bytes."""
    row, piece = divmod32(item, pieces)
    begin = piece * span
    return row, begin, min(begin + span, n)


@cuda.jit(device=True)
def lane_place(width, lane):
    """Where ``lane`` sits in a warp step of ``32 // width`` items of ``width`` entries each: ``(row, column,
    in_step)``, its item's row in the step and its entry column; ``in_step`` is False on the lanes past the
    step's ``32 // width * width`` entries. The same at every step: computed once, outside the walk."""
    row, column = divmod32(lane, width)
    return row, column, row < quotient32(WARP, width)


@cuda.jit(device=True)
def item_lanes(place, width):
    """uint32 mask of the lanes of this lane's item (its :func:`lane_place` for ``width`` entries); 0 past the step."""
    row, _, in_step = place
    if not in_step:
        return np.uint32(0)
    return (np.uint32(FULL_MASK) >> np.uint32(WARP - width)) << np.uint32(row * width)


@cuda.jit(device=True)
def lane_entry(first_item, end, place):
    """Item and entry column a lane handles in the warp step starting at ``first_item``, from its
    :func:`lane_place`. Returns ``(item, column, active)``; lanes past the step or past ``end`` are inactive.
    """
    row, column, in_step = place
    item = first_item + row
    return item, column, in_step and item < end


@cuda.jit(device=True)
def source_of_row(rank_psum, row):
    """Source rank and slot of compact row ``row``, given the inclusive prefix sum of rows per source."""
    lo = 0
    hi = rank_psum.shape[0] - 1
    while lo < hi:  # first source whose inclusive sum exceeds row
        mid = (lo + hi) >> 1
        if rank_psum[mid] > row:
            hi = mid
        else:
            lo = mid + 1
    return lo, row - (rank_psum[lo - 1] if lo > 0 else 0)
