"""Soak test: many dispatch/combine rounds with changing routings, checked on a sample, memory watched.

Run under mpirun, one process per rank (every rank runs the same command)::

    launch/mpirun_cpu.sh 2 ep_comm.soak --iters 300 --create-close 10            # CPU, mpi backend
    launch/mpirun_gpu.sh 2 ep_comm.soak --backend nvshmem --iters 10000 --check-every 100 --json soak.json
    launch/mpirun_gpu.sh 2 ep_comm.soak --backend nvshmem --iters 0 --create-close 0 --repeat-deterministic 100

Three phases, each on its own Buffer(s):

1. **soak** (``--iters``): every iteration draws a plan shared by all ranks (from ``(seed, iteration)``,
   no communication): routing kind (uniform / hot / Zipf, ``ep_comm.testing.routing``), masked entries
   and tokens going nowhere, per-rank token counts in ``[0, max_tokens]`` (some ranks empty),
   compact or expand with an alignment of ``--alignments``, zero padding, ``cpu_sync``, weights,
   a cached replay. Every ``--check-every``-th iteration is checked in full: each rank rebuilds
   every rank's inputs from the seed and checks its received rows (each (token, rank) and
   (token, expert) pair exactly once, byte-exact, in order when deterministic) and the combine
   (bias, weights, the experts' output negated on odd ranks) bit for bit with the shared checker
   ``ep_comm.testing.check`` (the NumPy reference ``ep_comm.contract.layout`` / ``ep_comm.contract.reduce``). (With
   bfloat16 and two ranks the float32 sums are exact, so the order of the rank terms cannot show:
   ``--dtype float32`` checks it.) The memory this process holds (host RSS; GPU: CuPy pool bytes in
   use and this process's device memory per NVML, see ``ep_comm.process_memory``; the GPU-wide
   figure is reported only) is sampled; after ``--warmup`` iterations it must stay within
   ``--mem-tolerance-mib`` of its value at the end of the warm-up.
2. **determinism** (``--repeat-deterministic N``): a ``deterministic=True`` Buffer dispatches and
   combines the same inputs (hot expert, full ranks, compact and expand) N times; every output,
   handle field and combine result must be bitwise identical to the first repetition's.
3. **create/close** (``--create-close N``): N Buffers created, used for one checked round trip and
   closed; memory must not grow.

Shapes default by backend: CPU (mpi) 8 experts per rank, hidden 128, top-4, 48 tokens, bfloat16;
GPU (nvshmem) DeepSeek-V3's layer: 256 experts, hidden 7168 bfloat16, top-8, 512 tokens.
Rank 0 shows a one-line progress display on stderr (live on a TTY or with ``--progress``, else a
line per 10 %) and writes the JSON summary (``--json``). Exit status: 0 all checks passed, 1 a
check failed or an error was raised on some rank, 2 bad options, a ``--json`` path that cannot
be written, or an environment that cannot run ``--backend`` (checked before any work).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ep_comm.backends import resolve_backend
from ep_comm.buffer import Buffer
from ep_comm.cli import (
    ArgumentParser,
    environment_problem,
    exit_collectively,
    int_at_least,
    int_list,
    output_problem,
    usage_exit,
)
from ep_comm.cli.progress import Progress
from ep_comm.contract.arrays import to_host
from ep_comm.contract.choices import BACKENDS, TRANSPORTS, payload_dtype
from ep_comm.process_memory import MIB, MemoryProbe, MemoryTrack, memory_failures
from ep_comm.testing.check import DispatchOptions, Sources, check_round_trip, same_bytes
from ep_comm.testing.dtypes import DTYPE_NAMES
from ep_comm.testing.routing import KINDS, make_routing, mask_routing, random_payload, token_count

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MAX_REPORTED_FAILURES = 20  # failure lines kept in the summary (all ranks; the count covers all)
FORCED_STEPS = 4  # the first iterations run the worst cases, so warm-up reaches the peak memory


# ------------------------------------------------------------------ shapes and plans
@dataclass(frozen=True)
class Shape:
    """The Buffer geometry of a run."""

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens: int
    dtype: str


@dataclass(frozen=True)
class Step:
    """One iteration's plan, the same on every rank (drawn from ``(seed, index)``)."""

    index: int
    routing: str  # ep_comm.testing.routing kind
    mask_rate: float  # share of top-k entries set to -1
    nowhere_rate: float  # share of tokens with every entry -1
    token_mode: str  # random | full | some_empty | small
    expand: bool
    alignment: int
    zero_padding: bool
    cpu_sync: bool
    weights: bool  # dispatched; compact combine gathers them back, expand combine is weighted
    bias: bool  # combine with a bias [T, H]
    replay: bool  # a cached dispatch of another payload with the handle, then its combine
    check: bool  # full check of this iteration

    def describe(self) -> str:
        padding = " zero_padding" if self.zero_padding else ""
        mode = f"expand align={self.alignment}{padding}" if self.expand else "compact"
        flags = [f for f, on in (("cpu_sync=False", not self.cpu_sync), ("weights", self.weights),
                                 ("bias", self.bias), ("replay", self.replay)) if on]
        return (f"iteration {self.index} [{self.routing}, {mode}, tokens {self.token_mode}, mask {self.mask_rate}, "
                f"nowhere {self.nowhere_rate}{', ' if flags else ''}{', '.join(flags)}]")


def forced_step(index: int, alignment: int) -> Step:
    """The worst cases, run first: full ranks, worst-case (``cpu_sync=False``) outputs, the largest alignment."""
    expand, cpu_sync = index in (1, 2), index in (2, 3)
    return Step(index, "hot", 0.0, 0.0, "full", expand, alignment if expand else 1, expand, cpu_sync,
                weights=index % 2 == 1, bias=index % 2 == 0, replay=cpu_sync, check=True)


def plan_step(seed: int, index: int, check_every: int, alignments: Sequence[int]) -> Step:
    """The plan of iteration ``index``; a function of ``(seed, index)`` only."""
    if index < FORCED_STEPS:
        return forced_step(index, max(alignments))
    rng = np.random.default_rng((seed, index, 0))
    expand = bool(rng.random() < 0.5)
    return Step(
        index=index,
        routing=str(rng.choice(KINDS)),
        mask_rate=float(rng.choice([0.0, 0.0, 0.1, 0.5])),
        nowhere_rate=float(rng.choice([0.0, 0.0, 0.1])),
        token_mode=str(rng.choice(["random", "random", "full", "some_empty", "small"])),
        expand=expand,
        alignment=int(rng.choice(alignments)) if expand else 1,
        zero_padding=bool(rng.random() < 0.5),
        cpu_sync=bool(rng.random() < 0.75),
        weights=bool(rng.random() < 0.5),
        bias=bool(rng.random() < 0.5),
        replay=bool(rng.random() < 0.25),
        check=index % check_every == 0,
    )


@dataclass
class RankInputs:
    """One rank's inputs of one iteration."""

    rows: np.ndarray  # [T] int64: payload row t is row rows[t] of the base payload
    topk_idx: np.ndarray  # [T, K] int64, -1 = no expert
    topk_weights: np.ndarray  # [T, K] float32


def rank_inputs(shape: Shape, step: Step, seed: int, rank: int, base_rows: int) -> RankInputs:
    """``rank``'s inputs of ``step``: a function of ``(seed, step, rank)``, so every rank can rebuild anyone's."""
    rng = np.random.default_rng((seed, step.index, rank + 1))
    t = token_count(step.token_mode, shape.max_tokens, rng, rank, turn=step.index)
    routing = make_routing(step.routing, t, shape.num_experts, shape.num_topk, seed=(seed, step.index, rank, 1),
                           hot_expert=(seed + step.index) % shape.num_experts)
    idx = mask_routing(routing.topk_idx, rng, entry_rate=step.mask_rate, token_rate=step.nowhere_rate)
    return RankInputs(rng.integers(0, base_rows, t), idx, routing.topk_weights)


def base_payload(shape: Shape, seed: int) -> np.ndarray:
    """``[2 * max_tokens, H]`` payload rows every iteration picks its tokens from; some entries are -0.0."""
    return random_payload(np.random.default_rng((seed, 1 << 30)), (2 * shape.max_tokens, shape.hidden),
                          payload_dtype(shape.dtype), negative_zero_rate=0.01)


def replay_rows(rows: np.ndarray, base_rows: int) -> np.ndarray:
    """``[T]`` base rows of the replay's payload (another payload, the same routing)."""
    return (rows + 1) % base_rows


def bias_rows(rows: np.ndarray, base_rows: int) -> np.ndarray:
    """``[T]`` base rows of the combine's bias."""
    return (rows + 2) % base_rows


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


# ------------------------------------------------------------------ phases
def progress_detail(failures: int, memory: Dict[str, int]) -> str:
    """The tail of a progress line: failures so far and the last memory sample."""
    mem = " ".join(f"{k.replace('_bytes', '')}={v / MIB:.0f}MiB" for k, v in memory.items())
    return f"failures={failures} {mem}"


@dataclass
class Run:
    """What every phase needs: the communicator, options, shape, arrays and memory probe."""

    comm: MPI.Comm
    args: argparse.Namespace
    shape: Shape
    backend: str
    base: np.ndarray  # [2 * max_tokens, H] host payload rows
    probe: MemoryProbe
    progress: Progress
    io: Optional[ArrayIO] = None  # made with the first Buffer, which picks this rank's GPU

    def buffer(self, deterministic: bool) -> Buffer:
        """A Buffer of the run's shape (and, the first time, the run's ArrayIO on its device)."""
        s = self.shape
        buf = Buffer(self.comm, num_experts=s.num_experts, hidden=s.hidden, num_topk=s.num_topk,
                     num_max_tokens_per_rank=s.max_tokens, dtype=s.dtype, backend=self.backend,
                     deterministic=deterministic, timeout_s=self.args.timeout, transport=self.args.transport)
        if self.io is None:
            self.io = ArrayIO(buf.backend, self.base)
        return buf


def describe_error(exc: BaseException) -> str:
    """``Type: message``, followed by the exceptions it was raised while handling (e.g. a close that
    timed out after a failed step), oldest last."""
    parts = []
    while exc is not None and len(parts) < 4:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- while handling ".join(parts)


def guarded(failures: List[str], where: Callable[[], str], body: Callable[[], None]) -> None:
    """Run ``body``; an exception (a timeout, an unusable buffer, a bug) becomes a failure line
    that starts with ``where()`` (the phase and step it happened in)."""
    try:
        body()
    except Exception as exc:  # reported, then the phase ends: the buffer may have lost step
        failures.append(f"{where()}: {describe_error(exc)}")


def count_modes(modes: Dict[str, int], step: Step) -> None:
    """Add ``step`` to the per-mode iteration counts of the summary."""
    for name, on in (("checked", step.check), ("expand", step.expand), ("cpu_sync_false", not step.cpu_sync),
                     ("replay", step.replay), ("weights", step.weights), ("bias", step.bias)):
        modes[name] = modes.get(name, 0) + int(on)


def soak_phase(run: Run) -> Dict[str, Any]:
    """``--iters`` planned iterations on one Buffer; memory sampled every ``--check-every`` iterations."""
    args = run.args
    warmup = args.warmup if args.warmup is not None else min(max(FORCED_STEPS, args.iters // 10), 200)
    failures: List[str] = []
    track, modes = MemoryTrack(), {}
    run.progress.start("soak", args.iters)
    start = time.perf_counter()
    current: List[Step] = []  # the step running, for the failure line of an exception

    def body() -> None:
        with run.buffer(args.deterministic) as buf:
            track.add(run.probe.sample(), is_baseline=warmup == 0)
            for i in range(args.iters):
                step = plan_step(args.seed, i, args.check_every, args.alignments)
                current[:] = [step]
                failures.extend(run_step(buf, run.io, run.shape, step, run.base, args.seed))
                count_modes(modes, step)
                if i + 1 == warmup or (i + 1) % args.check_every == 0 or i + 1 == args.iters:
                    track.add(run.probe.sample(), is_baseline=i + 1 == warmup)
                run.progress.tick(i + 1, progress_detail(len(failures), track.samples[-1]))

    guarded(failures, lambda: f"rank {run.comm.rank}: soak" + (f", {current[0].describe()}" if current else ""), body)
    elapsed = time.perf_counter() - start
    memory = track.summary(args.mem_tolerance_mib * MIB)
    failures += memory_failures("soak", memory, args.mem_tolerance_mib * MIB)
    return {"iters": args.iters, "warmup": warmup, "elapsed_s": elapsed, "iters_per_s": args.iters / max(elapsed, 1e-9),
            "modes": modes, "memory": memory, "memory_notes": run.probe.notes(), "failures": failures}


def create_close_phase(run: Run) -> Dict[str, Any]:
    """``--create-close`` Buffers created, used for one checked round trip each, closed; memory must not grow."""
    args, n = run.args, run.args.create_close
    failures: List[str] = []
    track = MemoryTrack()
    track.add(run.probe.sample())
    run.progress.start("create/close", n)
    start = time.perf_counter()

    def body() -> None:
        for i in range(n):
            with run.buffer(deterministic=i % 2 == 0) as buf:
                step = plan_step(args.seed + 1, i, 1, args.alignments)  # the worst cases first
                failures.extend(run_step(buf, run.io, run.shape, step, run.base, args.seed + 1))
            track.add(run.probe.sample(), is_baseline=i + 1 == min(FORCED_STEPS, n))
            run.progress.tick(i + 1, progress_detail(len(failures), track.samples[-1]))

    guarded(failures, lambda: f"rank {run.comm.rank}: create/close, buffer {len(track.samples) - 1}", body)
    elapsed = time.perf_counter() - start
    memory = track.summary(args.mem_tolerance_mib * MIB)
    failures += memory_failures("create/close", memory, args.mem_tolerance_mib * MIB)
    return {"buffers": n, "elapsed_s": elapsed, "memory": memory, "memory_notes": run.probe.notes(),
            "failures": failures}


def outputs_of(buf: Buffer, io: ArrayIO, mine: RankInputs, expand: bool, alignment: int) -> Dict[str, Any]:
    """Every output of one dispatch + weighted combine, by name (backend arrays)."""
    out = buf.dispatch(io.payload(mine.rows), io.put(mine.topk_idx), io.put(mine.topk_weights), expand=expand,
                       expert_alignment=alignment, zero_padding=True)
    res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
    h = out.handle
    return {"recv_x": out.recv_x, "recv_topk_idx": out.recv_topk_idx, "recv_topk_weights": out.recv_topk_weights,
            "recv_src_metadata": h.recv_src_metadata, "psum_num_recv_tokens_per_rank": h.psum_num_recv_tokens_per_rank,
            "psum_num_recv_tokens_per_expert": h.psum_num_recv_tokens_per_expert,
            "dst_buffer_slot_idx": h.dst_buffer_slot_idx, "combine_x": res.x, "combine_topk_weights": res.topk_weights}


def digest(arrays: Dict[str, Any]) -> str:
    """sha256 over the names and bytes of ``arrays`` (copied to the host)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(to_host(arrays[name])).view(np.uint8).tobytes())
    return h.hexdigest()


def determinism_phase(run: Run) -> Dict[str, Any]:
    """``--repeat-deterministic`` identical dispatch + combine rounds (compact and expand) on a
    ``deterministic=True`` Buffer: every output must equal the first round's, bit for bit."""
    n, args = run.args.repeat_deterministic, run.args
    failures: List[str] = []
    step = Step(0, "hot", 0.1, 0.05, "full", expand=False, alignment=1, zero_padding=True, cpu_sync=True,
                weights=True, bias=False, replay=False, check=True)
    mine = rank_inputs(run.shape, step, args.seed + 2, run.comm.rank, len(run.base))
    modes = {"compact": (False, 1), "expand": (True, max(args.alignments))}
    first: Dict[str, Dict[str, Any]] = {}
    differing: Dict[str, int] = {}
    run.progress.start("determinism", n)
    start = time.perf_counter()

    def body() -> None:
        with run.buffer(deterministic=True) as buf:
            for i in range(n):
                for mode, (expand, alignment) in modes.items():
                    got = outputs_of(buf, run.io, mine, expand, alignment)
                    if not first.get(mode):
                        first[mode] = got
                    for name in got:
                        if not run.io.equal_bits(got[name], first[mode][name]):
                            differing[f"{mode}.{name}"] = differing.get(f"{mode}.{name}", 0) + 1
                run.progress.tick(i + 1, progress_detail(len(differing), {}))

    guarded(failures, lambda: f"rank {run.comm.rank}: determinism", body)
    failures += [f"rank {run.comm.rank}: determinism: {name} differed from the first round in {count} of {n - 1} "
                 "later rounds" for name, count in sorted(differing.items())]
    return {"repeats": n, "elapsed_s": time.perf_counter() - start, "differing": differing,
            "digest": {mode: digest(outs) for mode, outs in first.items()}, "failures": failures}


# ------------------------------------------------------------------ command line
GPU_SHAPE = dict(experts=256, hidden=7168, topk=8, max_tokens=512)  # DeepSeek-V3 layer, up to 512 tokens
CPU_SHAPE = dict(experts_per_rank=8, hidden=128, topk=4, max_tokens=48)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ep_comm.soak", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 every check passed on every rank, 1 a check failed or an error was raised, "
               "2 bad options, an unwritable --json path or no GPU stack for --backend nvshmem. "
               "Shapes default by backend (see the module docstring).")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="ep_comm backend (default: auto)")
    p.add_argument("--transport", choices=TRANSPORTS, default="stores",
                   help="nvshmem backend: peer stores or nvshmem puts, Buffer(transport=...) (default: stores)")
    p.add_argument("--iters", type=int_at_least(0), default=10000, help="soak iterations (default: 10000; 0 skips)")
    p.add_argument("--check-every", type=int_at_least(1), default=100,
                   help="full check and memory sample every k-th iteration (default: 100)")
    p.add_argument("--warmup", type=int_at_least(0),
                   help="iterations before the memory baseline (default: iters/10, at least 4, at most 200)")
    p.add_argument("--create-close", type=int_at_least(0), default=100,
                   help="Buffers to create, use once and close (default: 100; 0 skips)")
    p.add_argument("--repeat-deterministic", type=int_at_least(0), default=0,
                   help="identical deterministic rounds whose outputs must be bitwise equal (default: 0 = skip)")
    p.add_argument("--deterministic", action="store_true",
                   help="soak on a deterministic=True Buffer (order checked too)")
    p.add_argument("--experts", type=int_at_least(1), help="global experts (default: GPU 256, CPU 8 per rank)")
    p.add_argument("--hidden", type=int_at_least(1), help="hidden size (default: GPU 7168, CPU 128)")
    p.add_argument("--topk", type=int_at_least(1), help="top-k (default: GPU 8, CPU 4)")
    p.add_argument("--max-tokens", type=int_at_least(1), help="num_max_tokens_per_rank (default: GPU 512, CPU 48)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="payload dtype (default: bfloat16)")
    p.add_argument("--alignments", type=int_list("expert alignments", 1, "1,2,8"), default=[1, 2, 8],
                   help="expand alignments to draw from (default: 1,2,8)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of every plan and input (default: 0)")
    p.add_argument("--timeout", type=float, default=60.0, help="Buffer timeout_s (default: 60)")
    p.add_argument("--mem-tolerance-mib", type=float, default=64.0,
                   help="allowed memory growth after warm-up, per metric (default: 64 MiB)")
    p.add_argument("--json", metavar="PATH", help="write the summary (rank 0) as JSON")
    p.add_argument("--progress", action="store_true", help="redraw the progress line in place even without a TTY")
    p.add_argument("--quiet", action="store_true", help="no progress lines (failures and the summary still print)")
    return p


def shape_of(args: argparse.Namespace, backend: str, num_ranks: int) -> Shape:
    """The run's shape: the options given, the backend's defaults for the rest."""
    gpu = backend == "nvshmem"
    experts = args.experts or (GPU_SHAPE["experts"] if gpu else CPU_SHAPE["experts_per_rank"] * num_ranks)
    defaults = GPU_SHAPE if gpu else CPU_SHAPE
    return Shape(experts, args.hidden or defaults["hidden"], args.topk or defaults["topk"],
                 args.max_tokens or defaults["max_tokens"], args.dtype)


def usage_problem(shape: Shape, num_ranks: int) -> Optional[str]:
    if shape.num_experts % num_ranks:
        return f"--experts={shape.num_experts}: must be divisible by the {num_ranks} ranks of this run"
    if shape.num_topk > shape.num_experts:
        return f"--topk={shape.num_topk}: must not exceed --experts={shape.num_experts}"
    return None


def summarize(comm: MPI.Comm, meta: Dict[str, Any], phases: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Gather every rank's phase results to rank 0: failures merged, per-rank memory kept."""
    gathered = comm.gather(phases, root=0)
    if comm.rank != 0:
        return None
    summary = dict(meta)
    failures = [f for rank_phases in gathered for p in rank_phases.values() for f in p["failures"]]
    for name in phases:
        per_rank = [g[name] for g in gathered]
        merged = {k: v for k, v in per_rank[0].items() if k not in ("failures", "memory", "digest")}
        merged["elapsed_s"] = max(p["elapsed_s"] for p in per_rank)
        for key in ("memory", "digest"):
            if key in per_rank[0]:
                merged[key] = {f"rank{r}": p[key] for r, p in enumerate(per_rank)}
        merged["failures"] = sum(len(p["failures"]) for p in per_rank)
        summary[name] = merged
    summary["ok"] = not failures
    summary["failures"] = {"count": len(failures), "first": failures[:MAX_REPORTED_FAILURES]}
    return summary


def print_summary(summary: Dict[str, Any]) -> None:
    """A few lines on stdout: one per phase, then the first failures."""
    for name in ("soak", "determinism", "create_close"):
        if name in summary:
            p = summary[name]
            mem = "; ".join(f"{r}: " + ", ".join(f"{k.replace('_bytes', '')} {m['start'] / MIB:.0f}->"
                                                 f"{m['end'] / MIB:.0f} (max {m['max'] / MIB:.0f}) MiB"
                                                 for k, m in metrics.items())
                            for r, metrics in p.get("memory", {}).items())
            print(f"[ep_comm.soak] {name}: {p['failures']} failures in {p['elapsed_s']:.1f} s"
                  f"{'; memory ' + mem if mem else ''}", flush=True)
            for note in p.get("memory_notes", []):
                print(f"[ep_comm.soak] {name}: memory: {note}", flush=True)
    for line in summary["failures"]["first"]:
        print(f"[ep_comm.soak] FAILED {line}", flush=True)
    print(f"[ep_comm.soak] {'OK' if summary['ok'] else 'FAILED'}", flush=True)


def main(argv: Optional[List[str]] = None, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Run the phases the options ask for on every rank of ``comm``; every rank returns the same exit status."""
    args = parser().parse_args(argv)
    code = usage_exit("ep_comm.soak", comm, environment_problem(comm, args.backend)
                      or (output_problem("--json", args.json) if comm.rank == 0 else None))
    if code is not None:
        return code
    backend = resolve_backend(args.backend)
    shape = shape_of(args, backend, comm.size)
    problem = usage_problem(shape, comm.size)
    if problem:
        if comm.rank == 0:
            print(f"ep_comm.soak: {problem}", file=sys.stderr)
        return EXIT_USAGE
    base = base_payload(shape, args.seed)
    show = comm.rank == 0 and not args.quiet
    run = Run(comm, args, shape, backend, base, MemoryProbe(gpu=backend == "nvshmem"),
              Progress("ep_comm.soak", "{label} {done}/{total} {rate:.1f}/s {detail}",
                       live=show and (args.progress or sys.stderr.isatty()), periodic=show, redraw_s=0.5))
    phases = {}
    for name, count, phase in (("soak", args.iters, soak_phase), ("determinism", args.repeat_deterministic,
                                                                   determinism_phase),
                               ("create_close", args.create_close, create_close_phase)):
        if count:
            phases[name] = phase(run)
    meta = {"backend": backend, "transport": args.transport, "ranks": comm.size, "shape": asdict(shape),
            "seed": args.seed, "deterministic": args.deterministic, "check_every": args.check_every,
            "alignments": args.alignments, "mem_tolerance_mib": args.mem_tolerance_mib}
    summary = summarize(comm, meta, phases)
    if comm.rank == 0:
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    return EXIT_OK if comm.bcast(summary["ok"] if comm.rank == 0 else None, root=0) else EXIT_FAILED


if __name__ == "__main__":
    exit_collectively(main)
