"""One soak iteration on a Buffer: the dispatch and combine of a planned step (and its cached replay) on the
backend's arrays, the experts' output sent back, and the full check of the round trip."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ep_comm.buffer import Buffer
from ep_comm.contract.arrays import to_host
from ep_comm.soak.plan import RankInputs, Shape, Step, bias_rows, rank_inputs, replay_rows
from ep_comm.testing.check import DispatchOptions, Sources, check_round_trip, same_bytes


def negated(xp, a):
    """``-a`` exactly, through the sign bit (float16/bfloat16/float32, NumPy or CuPy; no bfloat16 arithmetic)."""
    bits = xp.dtype(f"uint{8 * a.dtype.itemsize}")
    return (a.view(bits) ^ bits.type(1 << (8 * a.dtype.itemsize - 1))).view(a.dtype)


def expert_output(xp, rows, rank: int, expand: bool):
    """What rank ``rank``'s experts send back: compact rows negated on odd ranks (so that the
    order of the per-rank terms shows in the sum), expand rows unchanged (weights vary them)."""
    return negated(xp, rows) if rank % 2 and not expand else rows


# ------------------------------------------------------------------ arrays
class ArrayIO:
    """Host <-> backend arrays. The payload base lives on the backend as raw bytes ``[rows, H*itemsize]``
    uint8 and is gathered there by row (CuPy kernels need no bfloat16 support for that)."""

    def __init__(self, backend: str, base: np.ndarray):
        if backend == "nvshmem":
            import cupy

            self.xp, self.put = cupy, cupy.asarray
        else:
            self.xp, self.put = np, (lambda a: a)
        self.dtype, self.hidden = base.dtype, base.shape[1]
        self.base = self.put(np.ascontiguousarray(base).view(np.uint8))

    def payload(self, rows: np.ndarray):
        """``[T, H]`` payload on the backend: base rows ``rows``."""
        picked = self.base[self.put(rows)]
        return picked.view(self.dtype).reshape(len(rows), self.hidden)

    def equal_bits(self, a, b) -> bool:
        """Shape and bytes equal (on the backend, no copy to the host)."""
        return same_bytes(a, b, self.xp)


# ------------------------------------------------------------------ checks
def check_step(shape: Shape, step: Step, world: Sequence[RankInputs], payloads: Sequence[np.ndarray],
               bias: Optional[np.ndarray], out, res, me: int, deterministic: bool) -> List[str]:
    """Every check of one dispatch + combine of ``step`` on rank ``me`` (``ep_comm.testing.check``), from every
    rank's inputs ``world`` and payloads ``[T_r, H]``; returns the problems found."""
    sources = Sources(shape.num_experts, shape.max_tokens, [w.topk_idx for w in world], payloads,
                      [w.topk_weights for w in world])
    opts = DispatchOptions(step.expand, step.alignment, step.zero_padding, step.cpu_sync, step.weights, deterministic)
    return check_round_trip(sources, me, opts, out, res, () if bias is None else (bias,),
                            sent_back=lambda r, rows: expert_output(np, rows, r, step.expand))


# ------------------------------------------------------------------ one iteration
def round_trip(buf: Buffer, io: ArrayIO, step: Step, dispatch: Callable[[], Any], bias) -> tuple:
    """``(dispatch output, combine result)``: ``dispatch()``, then the combine of the experts' output."""
    out = dispatch()
    y = expert_output(io.xp, out.recv_x, buf.rank, step.expand)
    res = buf.combine(y, out.handle, topk_weights=out.recv_topk_weights if step.weights else None, bias=bias)
    return out, res


def run_step(buf: Buffer, io: ArrayIO, shape: Shape, step: Step, base: np.ndarray, seed: int) -> List[str]:
    """Dispatch + combine (and the replay) of ``step`` on every rank; the problems found when ``step.check``."""
    me, num_ranks, n = buf.rank, buf.num_ranks, len(base)
    mine = rank_inputs(shape, step, seed, me, n)
    weights = io.put(mine.topk_weights) if step.weights else None
    bias = io.payload(bias_rows(mine.rows, n)) if step.bias else None
    payload_rows = [lambda rows: rows]
    runs = [round_trip(buf, io, step, lambda: buf.dispatch(
        io.payload(mine.rows), io.put(mine.topk_idx), weights, expand=step.expand, expert_alignment=step.alignment,
        zero_padding=step.zero_padding, cpu_sync=step.cpu_sync), bias)]
    if step.replay:
        payload_rows.append(lambda rows: replay_rows(rows, n))
        runs.append(round_trip(buf, io, step, lambda: buf.dispatch(
            io.payload(replay_rows(mine.rows, n)), handle=runs[0][0].handle, cpu_sync=step.cpu_sync), bias))
    if not step.check:
        return []
    world = [mine if r == me else rank_inputs(shape, step, seed, r, n) for r in range(num_ranks)]
    host_bias = base[bias_rows(mine.rows, n)] if step.bias else None
    problems = []
    for i, ((out, res), rows_of) in enumerate(zip(runs, payload_rows)):
        payloads = [base[rows_of(w.rows)] for w in world]
        found = check_step(shape, step, world, payloads, host_bias, out, res, me, buf.deterministic)
        problems += [f"rank {me}: {step.describe()}{' replay' if i else ''}: {p}" for p in found]
    if step.replay and not np.array_equal(to_host(runs[1][0].handle.recv_src_metadata),
                                          to_host(runs[0][0].handle.recv_src_metadata)):
        problems.append(f"rank {me}: {step.describe()}: the replay's metadata differs from the dispatch's")
    return problems
