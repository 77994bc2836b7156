"""The phases of a soak run, each on its own Buffer(s): the planned iterations (``--iters``), the determinism
repeats (``--repeat-deterministic``) and the Buffers created and closed (``--create-close``). Each returns this
rank's results: counts, elapsed time, memory track, failure lines."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from ep_comm.buffer import Buffer
from ep_comm.cli.progress import Progress
from ep_comm.contract.arrays import to_host
from ep_comm.soak.memory import MIB, MemoryProbe, MemoryTrack, memory_failures
from ep_comm.soak.plan import FORCED_STEPS, RankInputs, Shape, Step, plan_step, rank_inputs
from ep_comm.soak.round_trip import ArrayIO, run_step


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
                     deterministic=deterministic, timeout_s=self.args.timeout, transport=self.args.transport,
                     scaleup_ranks=self.args.scaleup_ranks, forwarding=self.args.forwarding)
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
    waits: List[Any] = []  # the Buffer's wait statistics at the end (Buffer.wait_stats().table), for the summary

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
            waits.append(buf.wait_stats().table.tolist())

    guarded(failures, lambda: f"rank {run.comm.rank}: soak" + (f", {current[0].describe()}" if current else ""), body)
    elapsed = time.perf_counter() - start
    memory = track.summary(args.mem_tolerance_mib * MIB)
    failures += memory_failures("soak", memory, args.mem_tolerance_mib * MIB)
    return {"iters": args.iters, "warmup": warmup, "elapsed_s": elapsed, "iters_per_s": args.iters / max(elapsed, 1e-9),
            "modes": modes, "memory": memory, "memory_notes": run.probe.notes(), "failures": failures,
            "wait_table": waits[0] if waits else None}


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
