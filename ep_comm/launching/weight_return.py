"""Launches of the top-k weights' return route in a combine (kernels: ``ep_comm.kernels.weight_return``).

One thread per (row or token, top-k entry), ``THREADS`` to a block, at most ``max_blocks`` blocks
(grid-stride loops cover the rest); launched through a ``Kernels.launcher`` (pre-bound launches on a GPU, so that
recorded calls record them).
"""
from __future__ import annotations

from typing import Any

from ep_comm.kernels.weight_return import gather_weights_kernel, send_weights_kernel

__all__ = ["THREADS", "send_weights", "gather_weights"]

THREADS = 256


def _grid(work: int, cap: int) -> int:
    """Blocks for ``work`` threads, at least 1 and at most ``cap``."""
    return max(1, min(-(-work // THREADS), cap))


def send_weights(launcher: Any, weight_bits: Any, expand: bool, recv_src_metadata: Any, rank_psum: Any, metas: Any, *,
                 my_rank: int, step: Any, ahead: int, max_blocks: int) -> None:
    """Expert side; ``recv_src_metadata [N_out, 2 + K]`` int32 and ``rank_psum [R]`` int32 from the
    dispatch handle; ``weight_bits`` int32 (see the kernel); ``metas``: tuple of ``[P, R, max_tokens,
    1 + 2K]`` int32 views, one per rank, written at the parity of step ``step[0] + ahead`` (``step``: int64
    ``[1]``, see ``ep_comm.kernels.step_counter``). At most
    ``max_blocks`` CTAs through ``launcher`` (``Kernels.launcher``: ``launcher(kernel, blocks, threads)(*args)``)."""
    work = recv_src_metadata.shape[0] * (recv_src_metadata.shape[1] - 2)
    launcher(send_weights_kernel, _grid(work, max_blocks), THREADS)(
        weight_bits, expand, recv_src_metadata, rank_psum, my_rank, step, ahead, tuple(metas))


def gather_weights(launcher: Any, meta_by_parity: Any, step: Any, slot_idx: Any, topk_idx: Any, out_bits: Any, *,
                   experts_per_rank: int, my_rank: int, max_blocks: int, node_size: int = 0) -> None:
    """Source side into ``out_bits [T, K]`` int32 (float32 bits) from this rank's meta rows
    ``[2, R, max_tokens, 1 + 2K]`` at the parity of ``step``; ``slot_idx``/``topk_idx`` ``[T, K]`` from
    the dispatch; through ``launcher`` as :func:`send_weights`. ``node_size``: ranks per node of a forwarded combine
    (0: flat), whose entries owned in another node read the meta row of that node's forwarder."""
    if out_bits.shape[0] == 0:
        return
    launcher(gather_weights_kernel, _grid(out_bits.shape[0] * out_bits.shape[1], max_blocks), THREADS)(
        meta_by_parity, step, slot_idx, topk_idx, experts_per_rank, my_rank, node_size or meta_by_parity.shape[1],
        out_bits)
