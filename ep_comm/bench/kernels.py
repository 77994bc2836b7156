"""Time each dispatch/combine kernel on one GPU: ``python -m ep_comm.bench.kernels [--out FILE]``.

DeepSeek-V3 prefill shape by default (T=4096, H=7168 bfloat16, top-8 of 256 experts), with
``--ranks`` simulated ranks whose symmetric buffers all live on this GPU: every source's scatter
writes into all of them, receiver 0 runs the receive kernels. The count also runs on the first
``--decode-tokens`` tokens (decode). Per kernel: GPU time from CUDA events around each launch
(median and p99 over ``--iters`` after ``--warmup``), host time of the launch call itself in
microseconds per launch (median, nothing waited for), and bytes moved per GPU time where that
means something.
The timed launches queue up behind a sleeping kernel, so the events time the kernels alone, not
the host preparing each launch on an idle GPU (that cost is the host column).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np

from ep_comm.cli import ArgumentParser
from ep_comm.host import to_host
from ep_comm.kernels.sleep import sleep_kernel
from ep_comm.launching.kernels import (PLACE_ATOMIC, PLACE_CACHED, PLACE_STABLE, SLOT_ATOMIC, SLOT_CACHED, SLOT_STABLE,
                                       Kernels)
from ep_comm.launching.views import symmetric_views, word_dtype
from ep_comm.symmetric import SymmetricLayout


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m ep_comm.bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens of the extra count measurements")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="simulated destination buffers on this GPU")
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--blocks", type=int, default=264)
    p.add_argument("--warps-per-block", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def uniform_routing(rng: np.random.Generator, tokens: int, experts: int, topk: int) -> np.ndarray:
    """``[T, K]`` int64: K distinct experts per token, uniformly at random."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int64)


HOLD_US_PER_ITER = 2000  # longer than any launch call takes on the host


def time_launch(cp, launch: Callable[[], None], warmup: int, iters: int) -> dict:
    """GPU time (events around each launch) and host time of the call, in microseconds."""
    for _ in range(warmup):
        launch()
    cp.cuda.runtime.deviceSynchronize()
    sleep_kernel[1, 1](iters * HOLD_US_PER_ITER)
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    host = []
    for start, end in events:
        start.record()
        t0 = time.perf_counter()
        launch()
        host.append(time.perf_counter() - t0)
        end.record()
    cp.cuda.runtime.deviceSynchronize()
    gpu = np.array([cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in events])
    return {"gpu_us_p50": float(np.median(gpu)), "gpu_us_p99": float(np.percentile(gpu, 99)),
            "host_us_p50": float(np.median(host) * 1e6)}


class Bench:
    """Inputs, buffers and one :class:`Kernels` for the benchmark shape, plus one closure per measurement.

    ``cp`` is CuPy (NumPy in the simulator, for a smoke test of the closures).
    """

    def __init__(self, cp, a: argparse.Namespace):
        rng = np.random.default_rng(a.seed)
        self.cp, self.a = cp, a
        self.k = Kernels(cp, num_ranks=a.ranks, num_experts=a.experts, num_topk=a.topk, max_tokens=a.tokens,
                         num_blocks=a.blocks, warps_per_block=a.warps_per_block)
        sym = SymmetricLayout(a.ranks, a.tokens, a.hidden, a.topk, 2, a.experts // a.ranks)
        word = word_dtype(a.hidden, 2)
        self.views = [symmetric_views(cp.zeros(sym.total_bytes, np.uint8), sym, word) for _ in range(a.ranks)]
        self.rows = [v.rows for v in self.views]
        self.metas = [v.meta for v in self.views]
        self.topk = [cp.asarray(uniform_routing(rng, a.tokens, a.experts, a.topk)) for _ in range(a.ranks)]
        self.x = cp.asarray(rng.standard_normal((a.tokens, a.hidden), np.float32).astype(np.float16).view(np.uint16))
        self.w = cp.asarray(rng.random((a.tokens, a.topk), np.float32))
        self.dispatch_step = cp.ones(1, np.int64)  # step 1 (parity 1); the combine runs at step 2 (parity 0)
        self.combine_step = cp.full(1, 2, np.int64)
        self.sent = [self.dispatch_source(s, SLOT_STABLE) for s in range(a.ranks)]
        self.recv = self.k.receive_count(self.views[0].counts, self.views[0].meta, self.dispatch_step,
                                         alignment=a.alignment, expand=True, stable=True)
        self.num_rows, self.num_expanded = (int(v) for v in to_host(self.recv.totals))

    def dispatch_source(self, s: int, mode: int):
        """Count and scatter source ``s`` (parity 1), and write its counts where receivers read them."""
        lay = self.k.count(self.topk[s], stable=mode == SLOT_STABLE)
        self.k.scatter(self.x, self.topk[s], self.w, lay.slot_idx, self.rows, self.metas, src_rank=s,
                       step=self.dispatch_step, mode=mode)
        for d, view in enumerate(self.views):
            view.counts[1, s] = lay.count_words[d]
        return lay

    def outputs(self, expand: bool) -> tuple:
        cp, a = self.cp, self.a
        rows = self.num_expanded if expand else self.num_rows
        ids = (rows,) if expand else (rows, a.topk)
        return (cp.empty((rows, a.hidden), cp.uint16), cp.empty(ids, cp.int64), cp.empty(ids, cp.float32),
                cp.empty((self.num_rows, 2 + a.topk), cp.int32))

    def measurements(self) -> dict:
        k, a, own = self.k, self.a, self.views[0]
        lay = self.sent[0]
        compact_out, expand_out = self.outputs(False), self.outputs(True)
        row_bytes = a.hidden * 2
        pairs = int(to_host(lay.num_tokens_per_rank).sum())
        own_rows = int(to_host(self.recv.rank_psum)[0])  # the rows rank 0 received from itself

        def scatter(mode: int) -> Callable[[], None]:
            def run():
                if mode != SLOT_CACHED:
                    k.count(self.topk[0], stable=mode == SLOT_STABLE)
                k.scatter(self.x, self.topk[0], self.w, lay.slot_idx, self.rows, self.metas, src_rank=0,
                          step=self.dispatch_step, mode=mode)
            return run

        def receive_copy(expand: bool, mode: int, out: tuple) -> Callable[[], None]:
            return lambda: k.receive_copy(self.recv.rank_psum, own.rows, own.meta, self.dispatch_step, *out,
                                          expand=expand, mode=mode, expert_psum=self.recv.expert_psum,
                                          alignment=a.alignment, zero_padding=True)

        receive_copy(False, PLACE_ATOMIC, compact_out)()  # metadata that the cached and combine runs use
        receive_copy(True, PLACE_STABLE, expand_out)()
        y_compact = compact_out[0]
        y_expand = expand_out[0]
        weights = self.cp.ones(self.num_expanded, self.cp.float32)
        out = self.cp.empty((a.tokens, a.hidden), self.cp.uint16)
        decode = self.cp.ascontiguousarray(self.topk[0][: a.decode_tokens])
        return {
            "count (stable)": (lambda: k.count(self.topk[0], stable=True), 0),
            "count (atomic)": (lambda: k.count(self.topk[0], stable=False), 0),
            f"count (stable) T={a.decode_tokens}": (lambda: k.count(decode, stable=True), 0),
            f"count (atomic) T={a.decode_tokens}": (lambda: k.count(decode, stable=False), 0),
            "count + scatter (stable)": (scatter(SLOT_STABLE), pairs * row_bytes),
            "count + scatter (atomic)": (scatter(SLOT_ATOMIC), pairs * row_bytes),
            "scatter (cached)": (scatter(SLOT_CACHED), pairs * row_bytes),
            "receive_count (compact)": (lambda: k.receive_count(
                own.counts, own.meta, self.dispatch_step, alignment=1, expand=False, stable=False), 0),
            "receive_count (expand, stable)": (lambda: k.receive_count(
                own.counts, own.meta, self.dispatch_step, alignment=a.alignment, expand=True, stable=True), 0),
            "receive_copy (compact)": (receive_copy(False, PLACE_ATOMIC, compact_out), self.num_rows * row_bytes),
            "receive_count + copy (expand, atomic)": (self.with_count(receive_copy(True, PLACE_ATOMIC, expand_out)),
                                                      self.num_expanded * row_bytes),
            "receive_copy (expand, cached)": (receive_copy(True, PLACE_CACHED, expand_out),
                                              self.num_expanded * row_bytes),
            "combine_send (compact copy)": (lambda: k.combine_send(
                y_compact, compact_out[3], self.recv.rank_psum, self.rows, my_rank=0, step=self.combine_step,
                expand=False),
                (self.num_rows - own_rows) * row_bytes),  # rank 0's own rows stay in y
            "combine_send (expand reduce)": (lambda: k.combine_send(
                y_expand, expand_out[3], self.recv.rank_psum, self.rows, my_rank=0, step=self.combine_step,
                expand=True, weights=weights), self.num_expanded * row_bytes),
            "combine_reduce (compact, own rows from y)": (lambda: k.combine_reduce(
                own.rows, self.combine_step, lay.slot_idx, self.topk[0], out, my_rank=0, y=y_compact,
                recv_rank_psum=self.recv.rank_psum), pairs * row_bytes),
            "combine_reduce (expand partials)": (lambda: k.combine_reduce(
                own.rows, self.combine_step, lay.slot_idx, self.topk[0], out, my_rank=0), pairs * row_bytes),
        }

    def with_count(self, copy: Callable[[], None]) -> Callable[[], None]:
        """Atomic expand placement consumes its cursors: re-arm them with a receive_count before each copy."""
        own = self.views[0]

        def run():
            self.k.receive_count(own.counts, own.meta, self.dispatch_step, alignment=self.a.alignment, expand=True,
                                 stable=False)
            copy()
        return run


def main(argv=None) -> None:
    a = parse_args(argv)  # first: --help and option errors need no GPU stack
    import cupy as cp

    bench = Bench(cp, a)
    results = []
    print(f"T={a.tokens} H={a.hidden} bf16 top-{a.topk} of {a.experts}, {a.ranks} buffers on one GPU, "
          f"{a.blocks}x{a.warps_per_block} warps; received rows {bench.num_rows}, expanded {bench.num_expanded}")
    print(f"{'kernel':34s} {'gpu p50 us':>11s} {'gpu p99 us':>11s} {'host us':>8s} {'GB/s':>7s}")
    for name, (launch, nbytes) in bench.measurements().items():
        r = time_launch(cp, launch, a.warmup, a.iters)
        r.update(name=name, bytes=nbytes, gb_per_s=nbytes / r["gpu_us_p50"] / 1e3 if nbytes else None)
        results.append(r)
        rate = f"{r['gb_per_s']:7.0f}" if nbytes else f"{'':7s}"
        print(f"{name:34s} {r['gpu_us_p50']:11.1f} {r['gpu_us_p99']:11.1f} {r['host_us_p50']:8.1f} {rate}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "received_rows": bench.num_rows, "expanded_rows": bench.num_expanded,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
