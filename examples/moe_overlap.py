"""Two micro-batches of the ``examples.moe_layer`` layer, the dispatch of one overlapping the experts of the other.

    mpirun -np 2 python -m examples.moe_overlap --dtype float32                     # CPU: mpi backend, NumPy
    launch/mpirun_gpu.sh 2 examples.moe_overlap --dtype bfloat16 --json overlap.json  # GPUs: nvshmem, CuPy

A rank's ``T`` tokens are split into ``N`` contiguous micro-batches (``--micro-batches``, default 2: A and B),
each with its own ``ep_comm.Buffer`` of the same geometry (a Buffer with a pending receive hook takes no other
call) and, on the GPU, its own CUDA stream. The layer's steps are those of ``examples.moe_layer.MoELayer``;
the dispatch and combine are split into their send half and receive hook (``return_recv_hook=True``):

1. for each micro-batch: route, send its dispatch (A, then B: both in flight);
2. for each micro-batch: hook its dispatch (the host waits for its row counts), its experts, send its combine
   (A's experts run while B's dispatch is in flight; B's experts while A's combine is in flight);
3. for each micro-batch: hook its combine.

The other ranks' sends of a micro-batch land while this rank computes the one before it, and on the GPU the
two streams let one micro-batch's kernels run beside the other's. The concatenated outputs are checked
against the dense reference of ``examples.moe_layer`` with the same bounds (exit 1 when an error exceeds
its bound). Then the overlapped layer and the sum of its parts (the plain layer on A, then on B, each
``dispatch -> experts -> combine``, on the same Buffers) are timed, alternating, after warm-up: CUDA events
on the GPU (from an event all micro-batch streams wait for to one that waits for all of them),
``time.perf_counter`` on CPU; each rank's median, the largest over ranks. Rank 0 prints
``moe_overlap timing: overlapped X us vs sequential Y us: overlap saves Z %`` and writes them with ``--json``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

if __package__ in (None, ""):  # run as a file (python examples/moe_overlap.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ep_comm
from ep_comm.cli import environment_problem, exit_collectively, int_at_least, output_problem, usage_exit
from examples.moe_layer import (
    Array,
    ArrayOps,
    CheckResult,
    LayerOutput,
    MoELayer,
    array_ops,
    check_layer,
    check_line,
    make_params,
    open_buffer,
    parse_args,
    parser,
    seeded_tokens,
)

NAME = "moe_overlap"
Schedule = Callable[[], List[LayerOutput]]


# ------------------------------------------------------------------------------------- streams and clocks
class HostLanes:
    """NumPy on the mpi backend: no streams (every micro-batch runs on the host thread), ``perf_counter``."""

    def __init__(self) -> None:
        self._start = 0.0

    def on(self, i: int) -> ContextManager[Any]:
        """Micro-batch ``i``'s stream as the current one: nothing to switch on the host."""
        return contextlib.nullcontext()

    def start(self) -> None:
        """Begin a timed run."""
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Microseconds since :meth:`start` (everything is done: the host ran it)."""
        return (time.perf_counter() - self._start) * 1e6


class CudaLanes:
    """CuPy on the nvshmem backend: one non-blocking CUDA stream per micro-batch; times with CUDA events.

    :meth:`start` and :meth:`stop` are called with the caller's stream current (outside :meth:`on`): the
    micro-batch streams wait for an event recorded on it, and it waits for all of them, so the run is ordered
    after what came before (the tokens, the weights) and what comes after is ordered after the run.
    """

    def __init__(self, num_lanes: int):
        import cupy

        self.cupy = cupy
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(num_lanes)]
        self._start: Any = None

    def on(self, i: int) -> ContextManager[Any]:
        """Micro-batch ``i``'s stream as CuPy's current one (the Buffer and the experts launch on it)."""
        return self.streams[i]

    def start(self) -> None:
        """Record the start event on the current stream; every micro-batch stream waits for it."""
        self._start = self.cupy.cuda.Event()
        self._start.record()
        for stream in self.streams:
            stream.wait_event(self._start)

    def stop(self) -> float:
        """Make the current stream wait for every micro-batch stream, record the end event there, wait for it:
        GPU microseconds since :meth:`start`."""
        cuda = self.cupy.cuda
        current = cuda.get_current_stream()
        for stream in self.streams:
            done = cuda.Event(disable_timing=True)
            done.record(stream)
            current.wait_event(done)
        end = cuda.Event()
        end.record(current)
        end.synchronize()
        return float(cuda.get_elapsed_time(self._start, end)) * 1e3


Lanes = Union[HostLanes, CudaLanes]


def lanes_for(buf: ep_comm.Buffer, num_lanes: int) -> Lanes:
    """CUDA streams and events for the nvshmem backend, the host for mpi."""
    return CudaLanes(num_lanes) if buf.backend == "nvshmem" else HostLanes()


# ------------------------------------------------------------------------------------- schedules
def micro_batches(num_tokens: int, num_batches: int) -> List[slice]:
    """``num_batches`` contiguous slices of ``range(num_tokens)``, the first ``num_tokens % num_batches`` one
    token longer (as ``numpy.array_split``); some are empty when ``num_tokens < num_batches``."""
    bounds = np.cumsum([0] + [num_tokens // num_batches + (i < num_tokens % num_batches) for i in range(num_batches)])
    return [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


@dataclass
class InFlight:
    """A micro-batch whose dispatch or combine is sent and not yet received."""

    routing: Tuple[Array, Array]  # (topk_idx [T_i, K] int64, topk_weights [T_i, K] float32)
    hook: ep_comm.RecvHook  # its receive half
    inputs: Tuple[Any, ...]  # the send's inputs (and the dispatch it combines), held unchanged until the hook ran


def overlapped(layers: Sequence[MoELayer], xs: Sequence[Array], lanes: Lanes) -> List[LayerOutput]:
    """The layer on micro-batches ``xs[i] [T_i, H]`` (payload dtype), ``layers[i]`` on its own Buffer and
    lane: every dispatch sent; then for each micro-batch its dispatch received, its experts, its combine sent;
    then every combine received. Returns each micro-batch's output; collective over the Buffers' ranks."""
    sent = []
    for i, (layer, x) in enumerate(zip(layers, xs)):
        with lanes.on(i):
            routing = layer.route(x)
            sent.append(InFlight(routing, layer.dispatch(x, *routing, return_recv_hook=True), (x,)))
    combining = []
    for i, (layer, flight) in enumerate(zip(layers, sent)):
        with lanes.on(i):
            out = flight.hook()
            y = layer.compute(out)
            combining.append(InFlight(flight.routing, layer.combine(y, out, return_recv_hook=True), (y, out)))
    outputs = []
    for i, (layer, flight) in enumerate(zip(layers, combining)):
        with lanes.on(i):
            outputs.append(layer.output(flight.hook(), *flight.routing))
    return outputs


def sequential(layers: Sequence[MoELayer], xs: Sequence[Array], lanes: Lanes) -> List[LayerOutput]:
    """The sum of the parts: the plain layer (``dispatch -> experts -> combine``, the host waiting at each
    ``cpu_sync`` step) on each micro-batch in turn, on its own Buffer and lane; nothing overlaps."""
    outputs = []
    for i, (layer, x) in enumerate(zip(layers, xs)):
        with lanes.on(i):
            outputs.append(layer.forward(x))
    return outputs


def joined(ops: ArrayOps, outputs: Sequence[LayerOutput]) -> LayerOutput:
    """The micro-batches' outputs concatenated along the tokens (NumPy/CuPy ``ops``): the whole layer's."""
    return LayerOutput(*(ops.xp.concatenate(parts, axis=0) for parts in zip(*outputs)))


def timed(comm: MPI.Comm, lanes: Lanes, schedule: Schedule) -> Tuple[List[LayerOutput], float]:
    """One run of ``schedule`` started together on every rank (a barrier): its outputs and its microseconds."""
    comm.Barrier()
    lanes.start()
    outputs = schedule()
    return outputs, lanes.stop()


def median_us(comm: MPI.Comm, lanes: Lanes, schedules: Dict[str, Schedule], iters: int,
              warmup: int) -> Dict[str, float]:
    """Each schedule run ``warmup + iters`` times, the schedules alternating (drift hits them alike): the
    median microseconds of its last ``iters`` runs on each rank, the largest over ranks."""
    times: Dict[str, List[float]] = {name: [] for name in schedules}
    for _ in range(warmup + iters):
        for name, schedule in schedules.items():
            times[name].append(timed(comm, lanes, schedule)[1])
    return {name: comm.allreduce(float(np.median(t[warmup:])), op=MPI.MAX) for name, t in times.items()}


# ------------------------------------------------------------------------------------- command line
@dataclass(frozen=True)
class Timing:
    overlapped_us: float  # median of the overlapped layer (largest over ranks)
    sequential_us: float  # median of the plain layer on each micro-batch in turn (largest over ranks)

    @property
    def saves_pct(self) -> float:
        """How much shorter the overlapped layer is, in % of the sequential one (negative: longer)."""
        return 100.0 * (1.0 - self.overlapped_us / self.sequential_us) if self.sequential_us > 0 else 0.0

    def line(self) -> str:
        return (f"overlapped {self.overlapped_us:.1f} us vs sequential {self.sequential_us:.1f} us: overlap saves "
                f"{self.saves_pct:.1f} %")


def overlap_args(argv: Optional[Sequence[str]], num_ranks: int) -> argparse.Namespace:
    """The options of ``examples.moe_layer`` (``--tokens``: per rank, split into the micro-batches) and this
    example's own (exits 2 naming the option, its value and the rule)."""
    p = parser(f"python -m examples.{NAME}")
    p.description = ("Two (or more) micro-batches of the MoE layer, the dispatch of one overlapping the experts of "
                     "the other (send/receive split), checked against a dense reference and timed against the "
                     "layer run on each micro-batch in turn. Run under mpirun, one process per rank (GPU). Exit "
                     "status: 0 ok, 1 check failed, 2 bad options, an unwritable --json path or no GPU stack for "
                     "--backend nvshmem.")
    p.add_argument("--micro-batches", type=int_at_least(2), default=2,
                   help="micro-batches per rank, each with its own Buffer (default: 2)")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timed runs of each schedule (default: 20)")
    p.add_argument("--warmup", type=int_at_least(0), default=3,
                   help="untimed runs of each schedule before them (default: 3)")
    p.add_argument("--json", metavar="PATH", help="write the check and the timings (rank 0) as JSON")
    return parse_args(p.prog, argv, num_ranks, p)


def summary(comm: MPI.Comm, backend: str, args: argparse.Namespace, sizes: List[int], check: CheckResult,
            timing: Optional[Timing]) -> Dict[str, Any]:
    """What ``--json`` holds: the run's shape, the check and (when it passed) the timings."""
    return {"example": NAME, "ok": check.ok, "ranks": comm.size, "backend": backend, "dtype": args.dtype,
            "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "topk": args.topk,
            "alignment": args.alignment, "micro_batches": args.micro_batches, "micro_batch_tokens": sizes,
            "iters": args.iters, "warmup": args.warmup, "check": asdict(check),
            "clock": "cuda events" if backend == "nvshmem" else "perf_counter",
            "timing": "median over iters on each rank, largest over ranks",
            "overlapped_us": timing and timing.overlapped_us, "sequential_us": timing and timing.sequential_us,
            "overlap_saves_pct": timing and timing.saves_pct}


def run_overlap(args: argparse.Namespace, comm: Optional[MPI.Comm] = None) -> int:
    """Check the overlapped layer on ``comm`` (default: COMM_WORLD), then time it against the sequential one;
    rank 0 prints the check line and the timing line. Returns the exit status, the same on every rank: 0 ok,
    1 the check failed (nothing timed), 2 an unwritable ``--json`` or no GPU stack for ``--backend``."""
    comm = MPI.COMM_WORLD if comm is None else comm
    code = usage_exit(NAME, comm, environment_problem(comm, args.backend)
                      or (output_problem("--json", args.json) if comm.rank == 0 else None))
    if code is not None:
        return code
    params = make_params(args.hidden, args.ffn, args.experts, args.seed)
    slices = micro_batches(args.tokens, args.micro_batches)
    with contextlib.ExitStack() as stack:
        bufs = [stack.enter_context(open_buffer(comm, args, slices[0].stop)) for _ in slices]
        ops = array_ops(bufs[0])
        first = MoELayer(bufs[0], params, ops, args.alignment)
        layers = [first] + [first.on(buf) for buf in bufs[1:]]
        lanes = lanes_for(bufs[0], len(bufs))
        x = seeded_tokens(args, ops, comm.rank)
        xs = [x[s] for s in slices]
        schedules = {"overlapped_us": functools.partial(overlapped, layers, xs, lanes),
                     "sequential_us": functools.partial(sequential, layers, xs, lanes)}
        outputs, _ = timed(comm, lanes, schedules["overlapped_us"])
        check = check_layer(comm, ops, params, x, joined(ops, outputs))
        timing = Timing(**median_us(comm, lanes, schedules, args.iters, args.warmup)) if check.ok else None
        backend = bufs[0].backend
    if comm.rank == 0:
        print(check_line(NAME, comm, backend, args, check) + f" micro-batches={len(slices)}", flush=True)
        if timing:
            print(f"{NAME} timing: {timing.line()} (median of {args.iters}, {backend})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary(comm, backend, args, [s.stop - s.start for s in slices], check, timing), f, indent=2)
    return 0 if check.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_overlap(overlap_args(argv, MPI.COMM_WORLD.size))


if __name__ == "__main__":
    exit_collectively(main)
