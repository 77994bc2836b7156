"""Compile every kernel for sm_90 exactly as ``Kernels`` launches it, without a GPU (needs NVVM + NVRTC).

Run as ``python tests/kernels/compile_check.py OUT_DIR`` outside the simulator: ``Kernels`` methods
are called with NumPy arrays and a launcher that records instead of launching; each recorded
launch is compiled to PTX, written to ``OUT_DIR/<kernel>.ptx``. This type-checks the real kernels
(the simulator runs them as Python) and lets tests inspect the generated code. Every kernel must
also be disk-cached under the package's sources digest (``ep_comm/kernels/jit.py``) and compile without Numba's
runtime calls, as its dispatcher does (``ep_comm.kernels.numba_internals.runtime_off``).
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import ml_dtypes
import numba.cuda.dispatcher
import numpy as np
from numba import cuda, typeof

from ep_comm.contract.forward_inbox import ForwardInbox, inbox_views
from ep_comm.contract.symmetric import SymmetricLayout, symmetric_views, word_dtype
from ep_comm.kernels.jit import CACHE_STAMP
from ep_comm.kernels.numba_internals import compiles_without_runtime, runtime_off, source_stamp
from ep_comm.launching.fp8 import Fp8Rows
from ep_comm.launching.kernel_launches import PLACE_STABLE, SLOT_ATOMIC, SLOT_STABLE, Kernels

CC = (9, 0)
R, E, K, T, H = 2, 16, 4, 8, 24
LONG_H = 4096  # rows of several copy steps
FORMS = {1: "", 2: "-fp8pair", 3: "-fp8cast"}  # the scatter kernels' names by the length of their row source


class Recorder(Kernels):
    """``Kernels`` whose launches are recorded as ``(kernel, args)``."""

    def __init__(self, xp, **shapes: int) -> None:
        super().__init__(xp, **shapes)
        self.launches = []

    def _launch(self, kernel, stream, shared_bytes: int = 0, blocks: int = 0, warps_per_block: int = 0):
        return lambda *args: self.launches.append((kernel, args))


def record_all(dtype: np.dtype) -> list:
    k = Recorder(np, num_ranks=R, num_experts=E, num_topk=K, max_tokens=T)
    sym = SymmetricLayout(R, T, H, K, dtype.itemsize, E // R)
    views = [symmetric_views(np.zeros(sym.total_bytes, np.uint8), sym, word_dtype(H, dtype.itemsize)) for _ in range(R)]
    topk = np.zeros((T, K), np.int64)
    x = np.zeros((T, H), dtype)
    slot_idx = np.zeros((T, K), np.int32)
    step = np.ones(1, np.int64)
    k.check_routing(topk, stream=0)
    k.check_routing(topk.astype(np.int32), stream=0)
    k.check_routing(topk, into=np.full(2, -1, np.int64), stream=0)
    k.count(topk, stable=True, stream=0)
    k.scatter_min_units = 1  # few tokens: the unit kernel copies the rows only when told to (the rows kernel below)
    k.scatter(x, topk, np.zeros((T, K), np.float32), slot_idx, [v.rows for v in views], [v.meta for v in views],
              src_rank=0, step=step, mode=SLOT_STABLE, stream=0)
    k.receive_count(views[0].counts, views[0].meta, step, alignment=2, expand=False, stable=False, stream=0)
    counts = k.receive_count(views[0].counts, views[0].meta, step, alignment=1, expand=True, stable=True, stream=0)
    k.receive_counted(views[0].counts, views[0].rows, views[0].meta, step, np.zeros((R * T, H), dtype),
                      np.zeros((R * T, K), np.int64), np.zeros((R * T, K), np.float32),
                      np.zeros((R * T, 2 + K), np.int32), alignment=2, stream=0)
    for expand, ids_shape in ((False, (R * T, K)), (True, (R * T * K,))):
        k.receive_copy(counts.rank_psum, views[0].rows, views[0].meta, step, np.zeros((ids_shape[0], H), dtype),
                       np.zeros(ids_shape, np.int64), np.zeros(ids_shape, np.float32),
                       np.zeros((R * T, 2 + K), np.int32), expand=expand, mode=PLACE_STABLE,
                       expert_psum=counts.expert_psum, alignment=1, zero_padding=True, stream=0)
        k.combine_scatter(np.zeros((ids_shape[0], H), dtype), np.zeros((R * T, 2 + K), np.int32), counts.rank_psum,
                       [v.rows for v in views], my_rank=0, step=step, expand=expand,
                       weights=np.zeros(ids_shape[0], np.float32) if expand else None, stream=0)
    k.combine_reduce(views[0].rows, step, slot_idx, topk, np.zeros((T, H), dtype), my_rank=0,
                     bias=[np.zeros((T, H), np.float32), np.zeros((T, H), dtype)], stream=0)
    k.combine_reduce(views[0].rows, step, slot_idx, topk, np.zeros((T, H), dtype), my_rank=0,
                     stream=0)  # bf16: the wide one
    inbox = ForwardInbox(sym, 1)  # two nodes of one rank: each rank forwards for the other
    box = inbox_views(np.zeros(inbox.total_bytes, np.uint8), inbox, word_dtype(H, dtype.itemsize))
    others = np.ones(1, np.int32)
    k.inbox_send(x, topk, np.zeros((T, K), np.float32), slot_idx, [box.rows] * 2, [box.meta] * 2, [box.header] * 2,
                 [box.counts] * 2, src_rank=0, count_words=np.zeros((R, sym.count_words), np.int32), step=step,
                 stream=0)
    k.relay(box, others, [v.rows for v in views], [v.meta for v in views], [v.counts for v in views], node_first=0,
            step=step, stream=0)
    k.combine_meta(np.zeros((R * T, 2 + K), np.int32), np.zeros((R * T, K), np.int64), counts.rank_psum,
                   [box.meta] * 2, [box.header] * 2, my_rank=0, node_size=1, step=step, stream=0)
    k.node_reduce(box, others, [v.rows for v in views], [v.meta for v in views], my_rank=0, dtype=dtype, hidden=H,
                  step=step, scaleout=np.zeros(2, np.int64), stream=0)
    k.dispatch_rows(np.zeros((T, R), np.bool_), np.zeros(2, np.int64), node_size=1, my_rank=0, per_node=True, stream=0)
    k.combine_rows(counts.rank_psum, np.zeros(2, np.int64), node_size=1, my_rank=0, stream=0)
    long_rows = Recorder(np, num_ranks=R, num_experts=E, num_topk=K, max_tokens=T)  # the scatter cuts rows
    sym = SymmetricLayout(R, T, LONG_H, K, dtype.itemsize, E // R)
    views = [symmetric_views(np.zeros(sym.total_bytes, np.uint8), sym, word_dtype(LONG_H, dtype.itemsize))
             for _ in range(R)]
    long_rows.scatter(np.zeros((T, LONG_H), dtype), topk, np.zeros((T, K), np.float32), slot_idx,
                      [v.rows for v in views], [v.meta for v in views], src_rank=0, step=step, mode=SLOT_STABLE,
                      stream=0)
    pair = Fp8Rows(np.zeros((T, LONG_H), np.uint8), np.zeros((T, LONG_H // 128), np.float32), dtype)
    for fp8_rows in (pair, Fp8Rows(np.zeros((T, LONG_H), dtype), None, dtype)):  # the scatter writes FP8 rows
        # atomic slots: a launch that assigns them (scatter_kernel), then the rows' (stable: the rows' alone)
        long_rows.scatter(fp8_rows, topk, None, slot_idx, [v.rows for v in views], [v.meta for v in views],
                          src_rank=0, step=step, mode=SLOT_ATOMIC, stream=0)
    return k.launches + long_rows.launches


def main(out_dir: str) -> None:
    numba.cuda.dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)
    out = Path(out_dir)
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for kernel, args in record_all(dtype):
            assert source_stamp(kernel) == CACHE_STAMP, f"{kernel} is not cached by sources"
            assert compiles_without_runtime(kernel), f"{kernel} compiles with Numba's runtime calls"
            with runtime_off():  # as the dispatcher's own compile
                ptx, _ = cuda.compile_ptx(kernel.py_func, tuple(typeof(a) for a in args), cc=CC)
            name = kernel.py_func.__name__
            if name.startswith("scatter"):  # the form of its row source (its first argument, ep_comm.kernels.payload)
                name += FORMS[len(args[0])]
            (out / f"{name}.{dtype.name}.ptx").write_text(ptx)


if __name__ == "__main__":
    main(sys.argv[1])
