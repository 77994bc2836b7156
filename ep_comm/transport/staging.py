"""The staging layout of the puts transport: where the kernels write each destination's rows before the puts.

Plain array arithmetic (any array module), shared by ``NvshmemTransport`` and the simulator's
loopback transport in the tests.
"""
from __future__ import annotations

from typing import Any, Tuple

from ep_comm.contract.symmetric import SymmetricLayout


def staging_bytes(sym: SymmetricLayout) -> int:
    """Bytes of the puts staging area: ``2R - 1`` blocks of ``max_tokens`` rows and meta rows."""
    blocks = 2 * sym.num_ranks - 1
    return blocks * sym.max_tokens * (sym.row_bytes + 4 * sym.meta_words)


def staged_destinations(rows_stage: Any, meta_stage: Any, num_ranks: int) -> Tuple[tuple, tuple]:
    """Per-destination views for the kernels in puts mode, as tuples of ``[1, R, max_tokens, ...]``.

    ``rows_stage``/``meta_stage`` are ``[2R - 1, max_tokens, ...]`` blocks. The view of destination
    ``r`` starts at block ``r``, so the row a kernel writes at ``[0, me, slot]`` lands in block
    ``r + me``: each destination gets its own contiguous block, which ``put_blocks`` sends whole.
    """
    def view(stage, r: int):
        return stage[r: r + num_ranks].reshape((1,) + (num_ranks,) + tuple(stage.shape[1:]))

    return (tuple(view(rows_stage, r) for r in range(num_ranks)),
            tuple(view(meta_stage, r) for r in range(num_ranks)))
