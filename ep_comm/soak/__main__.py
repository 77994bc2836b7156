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
   use and this process's device memory per NVML, see ``ep_comm.soak.memory``; the GPU-wide
   figure is reported only) is sampled; after ``--warmup`` iterations it must stay within
   ``--mem-tolerance-mib`` of its value at the end of the warm-up.
2. **determinism** (``--repeat-deterministic N``): a ``deterministic=True`` Buffer dispatches and
   combines the same inputs (hot expert, full ranks, compact and expand) N times; every output,
   handle field and combine result must be bitwise identical to the first repetition's.
3. **create/close** (``--create-close N``): N Buffers created, used for one checked round trip and
   closed; memory must not grow.

Shapes default by backend: CPU (mpi) 8 experts per rank, hidden 128, top-4, 48 tokens, bfloat16;
GPU (nvshmem) DeepSeek-V3's layer: 256 experts, hidden 7168 bfloat16, top-8, 512 tokens.
``--transport`` (default ``auto``, the Buffer's), ``--scaleup-ranks N`` and ``--forwarding`` go to every Buffer.
Rank 0 shows a one-line progress display on stderr (live on a TTY or with ``--progress``, else a
line per 10 %) and writes the JSON summary (``--json``). Exit status: 0 all checks passed, 1 a
check failed or an error was raised on some rank, 2 bad options (a Buffer they cannot build included), a ``--json``
path that cannot be written, or an environment that cannot run ``--backend`` (checked before any work).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import List, Optional

from mpi4py import MPI

from ep_comm.backends import resolve_backend
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
from ep_comm.contract.choices import BACKENDS, TRANSPORTS
from ep_comm.soak.memory import MemoryProbe
from ep_comm.soak.phases import Run, create_close_phase, determinism_phase, soak_phase
from ep_comm.soak.plan import Shape, base_payload
from ep_comm.soak.summary import print_summary, summarize
from ep_comm.testing.dtypes import DTYPE_NAMES

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
GPU_SHAPE = dict(experts=256, hidden=7168, topk=8, max_tokens=512)  # DeepSeek-V3 layer, up to 512 tokens
CPU_SHAPE = dict(experts_per_rank=8, hidden=128, topk=4, max_tokens=48)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ep_comm.soak", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 every check passed on every rank, 1 a check failed or an error was raised, "
               "2 bad options, an unwritable --json path or no GPU stack for --backend nvshmem. "
               "Shapes default by backend (see the module docstring).")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="ep_comm backend (default: auto)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="nvshmem backend: peer stores, nvshmem puts, or auto (stores in a node, puts between nodes), "
                        "Buffer(transport=...) (default: auto, the Buffer's default)")
    p.add_argument("--scaleup-ranks", type=int_at_least(1), metavar="N",
                   help="ranks per (virtual) node, Buffer(scaleup_ranks=N); N must divide the rank count (default: "
                        "one node of every rank)")
    p.add_argument("--forwarding", action="store_true",
                   help="Buffer(forwarding=True): one scale-out row per token and destination node, through that "
                        "node's forwarder (on nvshmem with --transport auto only)")
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


def buffer_problem(run: Run) -> Optional[str]:
    """Why the run's Buffer cannot be built (``--scaleup-ranks``, ``--transport`` or ``--forwarding`` against the
    ranks and the backend: its constructor's ValueError, raised on every rank alike), or None. Collective: one
    Buffer is made and closed to find out."""
    try:
        run.buffer(run.args.deterministic).close()
    except ValueError as exc:
        return f"cannot build the Buffer: {exc}"
    return None


def main(argv: Optional[List[str]] = None, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Run the phases the options ask for on every rank of ``comm``; every rank returns the same exit status."""
    args = parser().parse_args(argv)
    code = usage_exit("ep_comm.soak", comm, environment_problem(comm, args.backend)
                      or (output_problem("--json", args.json) if comm.rank == 0 else None))
    if code is not None:
        return code
    backend = resolve_backend(args.backend)
    shape = shape_of(args, backend, comm.size)
    show = comm.rank == 0 and not args.quiet
    run = Run(comm, args, shape, backend, base_payload(shape, args.seed), MemoryProbe(gpu=backend == "nvshmem"),
              Progress("ep_comm.soak", "{label} {done}/{total} {rate:.1f}/s {detail}",
                       live=show and (args.progress or sys.stderr.isatty()), periodic=show, redraw_s=0.5))
    problem = usage_problem(shape, comm.size) or buffer_problem(run)  # the same on every rank
    if problem:
        if comm.rank == 0:
            print(f"ep_comm.soak: {problem}", file=sys.stderr)
        return EXIT_USAGE
    phases = {}
    for name, count, phase in (("soak", args.iters, soak_phase), ("determinism", args.repeat_deterministic,
                                                                   determinism_phase),
                               ("create_close", args.create_close, create_close_phase)):
        if count:
            phases[name] = phase(run)
    meta = {"backend": backend, "transport": args.transport, "scaleup_ranks": args.scaleup_ranks,
            "forwarding": args.forwarding, "ranks": comm.size, "shape": asdict(shape),
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
