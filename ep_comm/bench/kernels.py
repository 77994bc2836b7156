"""Time each dispatch/combine kernel on one GPU: ``python -m ep_comm.bench.kernels [--sms LIST] [--pair] [--out FILE]``.

DeepSeek-V3 prefill shape by default (T=4096, H=7168 bfloat16, top-8 of 256 experts), with
``--ranks`` simulated ranks whose symmetric buffers all live on this GPU: every source's scatter
writes into all of them, receiver 0 runs the receive kernels. The count also runs on the first
``--decode-tokens`` tokens (decode). Per kernel: GPU time from CUDA events around each launch
(median and p99 over ``--iters`` after ``--warmup``), host time of the launch call itself in
microseconds per launch (median, nothing waited for), and bytes moved per GPU time where that
means something.
The timed launches queue up behind a sleeping kernel (:mod:`ep_comm.bench.event_timing`), so the events
time the kernels alone, not the host preparing each launch on an idle GPU (that cost is the host column).

``--sms 16,24,32,66``: every measurement once per SM count, each with its own :class:`Kernels` of
:func:`~ep_comm.backends.sm_grid.grid_shape`'s launch shape for that many SMs (default ``all``: every SM
of the device, 264 blocks on an H200); each row carries its ``sms``.

``--pair``: sources 0 and 1 also run as two simulated ranks at once (:class:`Pair`), each on its own
non-blocking stream with its own ``Kernels`` of the ``--sms`` value's launch shape (a fixed SM share by
grid size: the hardware places the blocks of both), storing into each other's buffers. Per op (compact
dispatch: count + scatter, then receive count + copy; combine: combine_scatter, then combine_reduce), from
CUDA events on both streams: the wall time (first start to last end) and the tail, from the end of the
later send phase (the last remote store) to the later end. Between the phases the real protocol has a
signal and a wait; here CUDA events order them (each stream waits for the other's send event), so both
receives start after both sends finished. Today's kernels run the receive side after the transfer, so
the tail is the receive-side kernels' time; the fused kernels are expected to bring it to 3 us or less.
GB/s of a pair op: the payload bytes both ranks store into the buffers (dispatch: every scattered row;
combine: every row sent back, a rank's own rows excepted) per wall p50. JSON: the kernel rows under
``results`` (with ``sms``, ``num_blocks``, ``stream_blocks``), the pair rows under ``pair``.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, List, Optional

import numpy as np

from ep_comm.backends.sm_grid import grid_shape
from ep_comm.bench.__main__ import sm_counts
from ep_comm.bench.event_timing import HOLD_US_PER_ITER, CupyTiming, time_launch
from ep_comm.cli import ArgumentParser
from ep_comm.contract.arrays import to_host
from ep_comm.contract.symmetric import SymmetricLayout, symmetric_views, word_dtype
from ep_comm.kernels.numba_internals import interface_sync_disabled
from ep_comm.launching.kernel_launches import (
    PLACE_ATOMIC,
    PLACE_CACHED,
    PLACE_STABLE,
    SLOT_ATOMIC,
    SLOT_CACHED,
    SLOT_STABLE,
    Kernels,
)
from ep_comm.testing.routing import uniform_routing


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m ep_comm.bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens of the extra count measurements")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="simulated destination buffers on this GPU")
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--sms", type=sm_counts, default=[None], metavar="LIST",
                   help="SM counts, e.g. 16,24,32,66 ('all', the default: every SM of the device): every "
                        "measurement once per count, on grid_shape(count)'s launch shape; with --pair, per rank")
    p.add_argument("--pair", action="store_true",
                   help="also run dispatch and combine as two simulated ranks at once, each on its own stream")
    p.add_argument("--warps-per-block", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.pair and a.ranks != 2:
        p.error(f"--pair runs two simulated ranks: give --ranks 2, not {a.ranks}")
    return a


PAIR_HOLD_US_PER_ITER = 4 * HOLD_US_PER_ITER  # a pair iteration queues about ten launches on two streams


def make_kernels(cp, a: argparse.Namespace, sms: int) -> Kernels:
    """A :class:`Kernels` for the benchmark shape with :func:`grid_shape`'s launch shape for ``sms`` SMs."""
    return Kernels(cp, num_ranks=a.ranks, num_experts=a.experts, num_topk=a.topk, max_tokens=a.tokens,
                   warps_per_block=a.warps_per_block, **grid_shape(sms))


class Bench:
    """Inputs, buffers and one :class:`Kernels` for the benchmark shape on ``sms`` SMs, plus one closure per
    measurement.

    ``cp`` is CuPy (NumPy in the simulator, for a smoke test of the closures). Inputs: ``x [T, H]`` uint16
    (float16 bits), ``w [T, K]`` float32, ``topk[s] [T, K]`` int64 per source ``s``; ``views[r]``: rank r's
    symmetric buffer (:func:`symmetric_views`), every one on this GPU.
    """

    def __init__(self, cp, a: argparse.Namespace, sms: int):
        rng = np.random.default_rng(a.seed)
        self.cp, self.a, self.sms = cp, a, sms
        self.k = make_kernels(cp, a, sms)
        sym = SymmetricLayout(a.ranks, a.tokens, a.hidden, a.topk, 2, a.experts // a.ranks)
        word = word_dtype(a.hidden, 2)
        self.views = [symmetric_views(cp.zeros(sym.total_bytes, np.uint8), sym, word) for _ in range(a.ranks)]
        self.rows = [v.rows for v in self.views]
        self.metas = [v.meta for v in self.views]
        self.topk = [cp.asarray(uniform_routing(a.tokens, a.experts, a.topk, seed=(a.seed, s)).topk_idx)
                     for s in range(a.ranks)]
        self.x = cp.asarray(rng.standard_normal((a.tokens, a.hidden), np.float32).astype(np.float16).view(np.uint16))
        self.w = cp.asarray(rng.random((a.tokens, a.topk), np.float32))
        self.dispatch_step = cp.ones(1, np.int64)  # step 1 (parity 1); the combine runs at step 2 (parity 0)
        self.combine_step = cp.full(1, 2, np.int64)
        self.sent = [self.dispatch_source(s, SLOT_STABLE) for s in range(a.ranks)]
        self.recv = self.k.receive_count(self.views[0].counts, self.views[0].meta, self.dispatch_step,
                                         alignment=a.alignment, expand=True, stable=True, stream=0)
        self.num_rows, self.num_expanded = (int(v) for v in to_host(self.recv.totals))

    def dispatch_source(self, s: int, mode: int, k: Optional[Kernels] = None, stream: Any = 0):
        """Count and scatter source ``s`` (parity 1) with ``k`` (default: ours) on Numba stream ``stream`` (default:
        the legacy default stream), and write its counts where receivers read them."""
        k = k or self.k
        lay = k.count(self.topk[s], stable=mode == SLOT_STABLE, stream=stream)
        k.scatter(self.x, self.topk[s], self.w, lay.slot_idx, self.rows, self.metas, src_rank=s,
                  step=self.dispatch_step, mode=mode, stream=stream)
        for d, view in enumerate(self.views):
            view.counts[1, s] = lay.count_words[d]
        return lay

    def outputs(self, expand: bool, num_rows: Optional[int] = None) -> tuple:
        """``receive_copy``'s outputs for receiver 0, or a receiver of ``num_rows`` rows (compact): x
        ``[M or N, H]`` uint16, topk_idx and weights ``[M]`` or ``[N, K]`` int64 / float32, metadata
        ``[N, 2 + K]`` int32."""
        cp, a = self.cp, self.a
        num_rows = self.num_rows if num_rows is None else num_rows
        rows = self.num_expanded if expand else num_rows
        ids = (rows,) if expand else (rows, a.topk)
        return (cp.empty((rows, a.hidden), cp.uint16), cp.empty(ids, cp.int64), cp.empty(ids, cp.float32),
                cp.empty((num_rows, 2 + a.topk), cp.int32))

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
                    k.count(self.topk[0], stable=mode == SLOT_STABLE, stream=0)
                k.scatter(self.x, self.topk[0], self.w, lay.slot_idx, self.rows, self.metas, src_rank=0,
                          step=self.dispatch_step, mode=mode, stream=0)
            return run

        def receive_copy(expand: bool, mode: int, out: tuple) -> Callable[[], None]:
            return lambda: k.receive_copy(self.recv.rank_psum, own.rows, own.meta, self.dispatch_step, *out,
                                          expand=expand, mode=mode, expert_psum=self.recv.expert_psum,
                                          alignment=a.alignment, zero_padding=True, stream=0)

        receive_copy(False, PLACE_ATOMIC, compact_out)()  # metadata that the cached and combine runs use
        receive_copy(True, PLACE_STABLE, expand_out)()
        y_compact = compact_out[0]
        y_expand = expand_out[0]
        weights = self.cp.ones(self.num_expanded, self.cp.float32)
        out = self.cp.empty((a.tokens, a.hidden), self.cp.uint16)
        decode = self.cp.ascontiguousarray(self.topk[0][: a.decode_tokens])
        return {
            "count (stable)": (lambda: k.count(self.topk[0], stable=True, stream=0), 0),
            "count (atomic)": (lambda: k.count(self.topk[0], stable=False, stream=0), 0),
            f"count (stable) T={a.decode_tokens}": (lambda: k.count(decode, stable=True, stream=0), 0),
            f"count (atomic) T={a.decode_tokens}": (lambda: k.count(decode, stable=False, stream=0), 0),
            "count + scatter (stable)": (scatter(SLOT_STABLE), pairs * row_bytes),
            "count + scatter (atomic)": (scatter(SLOT_ATOMIC), pairs * row_bytes),
            "scatter (cached)": (scatter(SLOT_CACHED), pairs * row_bytes),
            "receive_count (compact)": (lambda: k.receive_count(
                own.counts, own.meta, self.dispatch_step, alignment=1, expand=False, stable=False, stream=0), 0),
            "receive_count (expand, stable)": (lambda: k.receive_count(
                own.counts, own.meta, self.dispatch_step, alignment=a.alignment, expand=True, stable=True,
                stream=0), 0),
            "receive_copy (compact)": (receive_copy(False, PLACE_ATOMIC, compact_out), self.num_rows * row_bytes),
            # a new routing's compact receive, cpu_sync=False: two launches (EP_COMM_KERNEL_LEGACY=count_in_copy) or one
            "receive_count + copy (compact)": (self.with_count(receive_copy(False, PLACE_ATOMIC, compact_out), False),
                                               self.num_rows * row_bytes),
            "receive_counted (compact)": (lambda: k.receive_counted(
                own.counts, own.rows, own.meta, self.dispatch_step, *compact_out, alignment=1, stream=0),
                self.num_rows * row_bytes),
            "receive_count + copy (expand, atomic)": (self.with_count(receive_copy(True, PLACE_ATOMIC, expand_out), True),
                                                      self.num_expanded * row_bytes),
            "receive_copy (expand, cached)": (receive_copy(True, PLACE_CACHED, expand_out),
                                              self.num_expanded * row_bytes),
            "combine_scatter (compact copy)": (lambda: k.combine_scatter(
                y_compact, compact_out[3], self.recv.rank_psum, self.rows, my_rank=0, step=self.combine_step,
                expand=False, stream=0),
                (self.num_rows - own_rows) * row_bytes),  # rank 0's own rows stay in y
            "combine_scatter (expand reduce)": (lambda: k.combine_scatter(
                y_expand, expand_out[3], self.recv.rank_psum, self.rows, my_rank=0, step=self.combine_step,
                expand=True, weights=weights, stream=0), self.num_expanded * row_bytes),
            "combine_reduce (compact, own rows from y)": (lambda: k.combine_reduce(
                own.rows, self.combine_step, lay.slot_idx, self.topk[0], out, my_rank=0, y=y_compact,
                recv_rank_psum=self.recv.rank_psum, stream=0), pairs * row_bytes),
            "combine_reduce (expand partials)": (lambda: k.combine_reduce(
                own.rows, self.combine_step, lay.slot_idx, self.topk[0], out, my_rank=0, stream=0), pairs * row_bytes),
        }

    def with_count(self, copy: Callable[[], None], expand: bool) -> Callable[[], None]:
        """A receive_count before each ``copy`` (atomic expand placement consumes its cursors: this re-arms them)."""
        own = self.views[0]
        alignment = self.a.alignment if expand else 1

        def run():
            self.k.receive_count(own.counts, own.meta, self.dispatch_step, alignment=alignment, expand=expand,
                                 stable=False, stream=0)
            copy()
        return run


class Pair:
    """Sources 0 and 1 of ``bench`` as two simulated ranks at once: rank r runs on its own stream of ``timing``
    (:class:`CupyTiming`) with its own :class:`Kernels` of ``sms`` SMs' launch shape, the Buffer's default
    (non-deterministic) compact path, storing into both ranks' buffers of ``bench``.

    Dispatch: send = count + scatter (+ the count words into every receiver's buffer, standing in for the
    signal's counts), receive = receive_count + receive_copy into ``out[r]`` (:meth:`Bench.outputs`, compact).
    Combine: send = combine_scatter of the received rows ``out[r][0]`` back to their sources, receive =
    combine_reduce into ``combined[r] [T, H]`` uint16 (the rows rank r received from itself read from ``y``).
    The combine uses the layouts and outputs of the latest dispatch, so a dispatch runs first.
    """

    def __init__(self, bench: Bench, timing: CupyTiming, sms: int):
        cp, a = bench.cp, bench.a
        self.b, self.timing, self.sms = bench, timing, sms
        self.streams = [timing.stream() for _ in range(2)]
        self.k = [make_kernels(cp, a, sms) for _ in self.streams]
        self.launch_streams = [timing.numba_stream(s) for s in self.streams]  # rank r's kernels launch on [r]
        counts = [to_host(bench.k.receive_count(bench.views[r].counts, bench.views[r].meta, bench.dispatch_step,
                                                alignment=1, expand=False, stable=False, stream=0).rank_psum)
                  for r in (0, 1)]
        rows = [int(c[-1]) for c in counts]
        own = [int(c[r]) - (int(c[r - 1]) if r else 0) for r, c in enumerate(counts)]
        self.out = [bench.outputs(False, n) for n in rows]
        self.combined = [cp.empty((a.tokens, a.hidden), np.uint16) for _ in range(2)]
        self.sent: List[Any] = [None, None]  # SendLayout of each rank's latest dispatch
        self.recv: List[Any] = [None, None]  # ReceiveCounts of each rank's latest dispatch
        row_bytes = a.hidden * 2
        self.dispatch_bytes = row_bytes * sum(int(to_host(bench.sent[r].num_tokens_per_rank).sum()) for r in (0, 1))
        self.combine_bytes = row_bytes * (sum(rows) - sum(own))  # own rows stay in y
        timing.synchronize()  # setup ran on the default stream, which the non-blocking streams do not wait for

    def dispatch_send(self, r: int) -> None:
        self.sent[r] = self.b.dispatch_source(r, SLOT_ATOMIC, self.k[r], self.launch_streams[r])

    def dispatch_receive(self, r: int) -> None:
        b, own = self.b, self.b.views[r]
        recv = self.recv[r] = self.k[r].receive_count(own.counts, own.meta, b.dispatch_step, alignment=1,
                                                      expand=False, stable=False, stream=self.launch_streams[r])
        self.k[r].receive_copy(recv.rank_psum, own.rows, own.meta, b.dispatch_step, *self.out[r], expand=False,
                               mode=PLACE_ATOMIC, expert_psum=recv.expert_psum, alignment=1, zero_padding=False,
                               stream=self.launch_streams[r])

    def combine_send(self, r: int) -> None:
        y, meta = self.out[r][0], self.out[r][3]
        self.k[r].combine_scatter(y, meta, self.recv[r].rank_psum, self.b.rows, my_rank=r, step=self.b.combine_step,
                                  expand=False, stream=self.launch_streams[r])

    def combine_receive(self, r: int) -> None:
        b = self.b
        self.k[r].combine_reduce(b.views[r].rows, b.combine_step, self.sent[r].slot_idx, b.topk[r], self.combined[r],
                                 my_rank=r, y=self.out[r][0], recv_rank_psum=self.recv[r].rank_psum,
                                 stream=self.launch_streams[r])

    def ops(self) -> dict:
        """name -> (send, receive, bytes both ranks store into the buffers), dispatch first."""
        return {"dispatch (compact)": (self.dispatch_send, self.dispatch_receive, self.dispatch_bytes),
                "combine (compact)": (self.combine_send, self.combine_receive, self.combine_bytes)}

    def step(self, send: Callable[[int], None], receive: Callable[[int], None], after: list) -> list:
        """Queue one op on both ranks: on each stream, after every event of ``after``, ``send(r)``; then, once
        both sends are done (each stream waits for the other's send event: the signal and wait of the real
        protocol), ``receive(r)``. Returns ``[start, sent, end]`` events per rank."""
        t, marks = self.timing, []
        with interface_sync_disabled():
            for r, stream in enumerate(self.streams):
                for event in after:
                    t.wait(stream, event)
                with t.current(stream):
                    start = t.record(stream)
                    send(r)
                    marks.append([start, t.record(stream)])
            for r, stream in enumerate(self.streams):
                t.wait(stream, marks[1 - r][1])
                with t.current(stream):
                    receive(r)
                    marks[r].append(t.record(stream))
        return marks


def queue_steps(pair: Pair, send: Callable[[int], None], receive: Callable[[int], None], after: list,
                count: int) -> list:
    """Queue ``count`` :meth:`Pair.step` s, the first after the events ``after``, each next one after both ranks
    ended the one before (the next sends store into buffers the receives read). Returns their events."""
    marks = []
    for _ in range(count):
        marks.append(pair.step(send, receive, after))
        after = [rank[2] for rank in marks[-1]]
    return marks


def time_pair(pair: Pair, send: Callable[[int], None], receive: Callable[[int], None], warmup: int,
              iters: int) -> dict:
    """Wall time (first start to last end) and tail (later send end to later end) of one op on both ranks, in
    microseconds, over ``iters`` iterations queued behind a hold; each iteration starts on both streams after
    both ended the one before. ``held``: the hold outlasted the queueing (else host time is in the figures)."""
    t = pair.timing
    queue_steps(pair, send, receive, [], warmup)
    t.synchronize()
    t.hold(pair.streams[0], iters * PAIR_HOLD_US_PER_ITER)
    gate = t.record(pair.streams[0])
    marks = queue_steps(pair, send, receive, [gate], iters)
    held = not t.done(gate)
    t.synchronize()
    at = np.array([[[t.elapsed_us(gate, e) for e in rank] for rank in m] for m in marks])  # [iters, 2, 3]
    wall = at[:, :, 2].max(axis=1) - at[:, :, 0].min(axis=1)
    tail = at[:, :, 2].max(axis=1) - at[:, :, 1].max(axis=1)
    return {"wall_us_p50": float(np.median(wall)), "wall_us_p99": float(np.percentile(wall, 99)),
            "tail_us_p50": float(np.median(tail)), "tail_us_p99": float(np.percentile(tail, 99)), "held": held}


def kernel_rows(bench: Bench, timing: CupyTiming) -> list:
    """Time every measurement of ``bench``; print and return one row each."""
    a, shape = bench.a, grid_shape(bench.sms)
    rows = []
    for name, (launch, nbytes) in bench.measurements().items():
        r = time_launch(timing, launch, a.warmup, a.iters)
        r.update(name=name, bytes=nbytes, gb_per_s=nbytes / r["gpu_us_p50"] / 1e3 if nbytes else None,
                 sms=bench.sms, **shape)
        rows.append(r)
        rate = f"{r['gb_per_s']:7.0f}" if nbytes else f"{'':7s}"
        print(f"{bench.sms:4d} {name:42s} {r['gpu_us_p50']:11.1f} {r['gpu_us_p99']:11.1f} {r['host_us_p50']:8.1f} "
              f"{rate}")
    return rows


def pair_rows(pair: Pair) -> list:
    """Time both ops of ``pair``; print and return one row each."""
    a, rows = pair.b.a, []
    for name, (send, receive, nbytes) in pair.ops().items():
        r = time_pair(pair, send, receive, a.warmup, a.iters)
        r.update(name=name, sms=pair.sms, **grid_shape(pair.sms), bytes=nbytes,
                 gb_per_s=nbytes / r["wall_us_p50"] / 1e3 if r["wall_us_p50"] > 0 else None)
        rows.append(r)
        rate = f"{r['gb_per_s']:7.0f}" if r["gb_per_s"] is not None else f"{'':7s}"
        note = "" if r["held"] else "  (the hold ran out while queueing: host time included)"
        print(f"{pair.sms:4d} {name:20s} {r['wall_us_p50']:11.1f} {r['wall_us_p99']:11.1f} {r['tail_us_p50']:11.1f} "
              f"{r['tail_us_p99']:11.1f} {rate}{note}")
    return rows


def run(cp, timing: CupyTiming, a: argparse.Namespace, device_sms: int) -> dict:
    """Every measurement (and with ``a.pair`` the pair's) per SM count of ``a.sms`` (None: ``device_sms``);
    prints the tables, returns what ``--out`` writes."""
    results, pairs, bench = [], [], None
    for sms in [n or device_sms for n in a.sms]:
        bench = None  # the previous SM count's buffers go first
        bench = Bench(cp, a, sms)
        shape = grid_shape(sms)
        print(f"T={a.tokens} H={a.hidden} bf16 top-{a.topk} of {a.experts}, {a.ranks} buffers on one GPU, "
              f"{sms} SMs: {shape['num_blocks']}x{a.warps_per_block} warps ({shape['stream_blocks']} streaming "
              f"blocks); received rows {bench.num_rows}, expanded {bench.num_expanded}")
        print(f"{'sms':>4s} {'kernel':42s} {'gpu p50 us':>11s} {'gpu p99 us':>11s} {'host us':>8s} {'GB/s':>7s}")
        results += kernel_rows(bench, timing)
        if a.pair:
            print("pair: ranks 0 and 1 at once, each on its own stream with the grid of 'sms' SMs; tail: from the "
                  "later send end (last remote store) to the later end")
            print(f"{'sms':>4s} {'pair op':20s} {'wall p50 us':>11s} {'wall p99 us':>11s} "
                  f"{'tail p50 us':>11s} {'tail p99 us':>11s} {'GB/s':>7s}")
            pairs += pair_rows(Pair(bench, timing, sms))
    return {"args": vars(a), "device_sms": device_sms, "received_rows": bench.num_rows,
            "expanded_rows": bench.num_expanded, "results": results, "pair": pairs}


def main(argv=None) -> None:
    a = parse_args(argv)  # first: --help and option errors need no GPU stack
    import cupy as cp

    device_sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    report = run(cp, CupyTiming(cp), a, device_sms)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
