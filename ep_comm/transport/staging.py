"""The staging layout of the puts: where the kernels write the rows of each destination reached through puts.

Plain array arithmetic (any array module), shared by ``NvshmemTransport`` and the simulator's
loopback transport in the tests.
"""
from __future__ import annotations

from typing import Any

from ep_comm.contract.symmetric import SymmetricLayout


def staging_blocks(num_ranks: int) -> int:
    """Blocks of ``max_tokens`` rows in the staging area: ``3R - 1`` (see :func:`staged_destination`)."""
    return 3 * num_ranks - 1


def staging_bytes(sym: SymmetricLayout) -> int:
    """Bytes of the puts staging area: :func:`staging_blocks` of ``max_tokens`` rows and as many of meta rows."""
    return staging_blocks(sym.num_ranks) * sym.max_tokens * (sym.row_bytes + 4 * sym.meta_words)


def staged_destination(stage: Any, r: int, num_ranks: int) -> Any:
    """The view the kernels write destination ``r``'s rows through when ``r`` is reached by puts: ``[2, R, max_tokens,
    ...]`` like a peer's rows or meta, over the ``[3R - 1, max_tokens, ...]`` blocks of ``stage``.

    The view starts at block ``r``, so the row a kernel from rank ``me`` writes at ``[parity, me, slot]`` lands in
    block ``r + parity * R + me``: at each step (one parity) each destination gets its own contiguous block, which
    ``put_blocks`` sends whole to the region ``[parity, me]`` of rank ``r``.
    """
    return stage[r: r + 2 * num_ranks].reshape((2, num_ranks) + tuple(stage.shape[1:]))
