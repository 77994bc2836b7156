"""The benchmark run: build a Buffer, run every point (and the GPU baselines), report on rank 0.

Every rank runs :func:`run` with the same options; decisions that could differ between ranks
(a missing optional package) are taken on rank 0 and broadcast, so all ranks stop together.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm import Buffer
from ep_comm.config import Config, ConfigError, load_config
from ep_comm.dtypes import payload_dtype

from . import report
from .measure import PointSpec, RankSample, cuda_timer, host_timer, run_point

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """The options and config cannot run on this communicator; the message says why."""


def _point_specs(cfg: Config, args: argparse.Namespace) -> List[PointSpec]:
    tokens = args.sweep or [args.tokens or cfg.tokens_per_rank]
    return [PointSpec(cfg.num_experts, cfg.hidden, cfg.num_topk, t, cfg.dtype,
                      routing=args.routing or cfg.routing.kind,
                      seed=cfg.routing.seed if args.seed is None else args.seed,
                      zipf_s=cfg.routing.zipf_s, hot_expert=cfg.routing.hot_expert, expand=args.expand,
                      expert_alignment=args.alignment, warmup=args.warmup, iters=args.iters)
            for t in tokens]


def _load(comm: MPI.Comm, args: argparse.Namespace) -> Config:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    if cfg.num_experts % comm.size:
        raise UsageError(f"config {cfg.name}: num_experts = {cfg.num_experts} is not divisible by the "
                         f"{comm.size} ranks of this run (experts are split evenly over ranks)")
    if args.plot:
        missing = comm.bcast(report.matplotlib_missing() if comm.rank == 0 else None, root=0)
        if missing:
            raise UsageError(missing)
    return cfg


def _device_path(buf: Buffer) -> Tuple[Callable, Callable[[np.ndarray], Any], str]:
    """(timer, host->device copy, timer name) for the buffer's backend."""
    if buf.backend == "nvshmem":
        import cupy

        return cuda_timer, cupy.asarray, "CUDA events"
    return host_timer, lambda a: a, "host wall-clock"


def _gpu_extras(comm: MPI.Comm, args: argparse.Namespace, timer: Callable, meta: Dict[str, Any]) -> Optional[Callable]:
    """On the GPU path: measure the NVLink ceiling into ``meta`` and return the per-point NCCL
    baseline runner, or None when ``--no-baselines`` or torch is missing (noted in ``meta``)."""
    from . import baselines

    try:
        ceiling = baselines.nvlink_ceiling(comm, baselines.nvshmem_peer_view, timer)
        meta["nvlink_ceiling_gbps"] = float(np.mean(comm.allgather(ceiling)))
    except Exception as exc:  # the ceiling is context, not the product: report why it is missing
        meta["nvlink_ceiling_gbps"] = None
        meta["nvlink_ceiling_error"] = f"{type(exc).__name__}: {exc}"
    if args.no_baselines:
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        meta["baselines"] = "skipped: torch is not installed"
        return None

    def nccl(spec: PointSpec, x: np.ndarray, topk_idx: np.ndarray) -> Dict[str, List[float]]:
        return baselines.time_nccl_baselines(comm, x, topk_idx, spec.num_experts, spec.warmup, spec.iters, timer)

    return nccl


def _meta(comm: MPI.Comm, cfg: Config, args: argparse.Namespace, spec: PointSpec, buf: Buffer,
          timer_name: str) -> Dict[str, Any]:
    return {
        "config": cfg.name, "backend": buf.backend, "ranks": comm.size, "routing": spec.routing,
        "seed": spec.seed, "dtype": cfg.dtype, "hidden": cfg.hidden, "num_experts": cfg.num_experts,
        "num_topk": cfg.num_topk, "mode": "expand" if args.expand else "compact",
        "expert_alignment": args.alignment, "deterministic": args.deterministic, "iters": args.iters,
        "warmup": args.warmup, "timer": timer_name, "num_sms": args.num_sms,
    }


def _write_outputs(args: argparse.Namespace, meta: Dict[str, Any], points: List[Dict[str, Any]]) -> None:
    from ep_comm.info import versions

    meta["versions"] = versions()
    if not args.quiet:
        print(report.format_report(meta, points), flush=True)
    else:
        for point in points:
            for failure in point["failures"]:
                print(f"ep_comm.bench: {point['tokens_per_rank']} tokens/rank: FAILED {failure}", file=sys.stderr)
    if args.json:
        report.write_json(args.json, meta, points)
    if args.csv:
        report.write_csv(args.csv, points)
    if args.plot:
        report.write_plot(args.plot, meta, points)


def run(args: argparse.Namespace, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Run the benchmark the options describe; every rank returns the same exit code."""
    try:
        cfg = _load(comm, args)
    except UsageError as exc:
        if comm.rank == 0:
            print(f"ep_comm.bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    specs = _point_specs(cfg, args)
    is_root = comm.rank == 0
    shown = is_root and not args.quiet
    progress = report.Progress(live=shown and (args.progress or sys.stderr.isatty()), final=shown)
    if is_root and args.num_sms is not None:
        print("ep_comm.bench: --num-sms is recorded but not used: the Buffer takes no SM count yet", file=sys.stderr)
    with Buffer(comm, num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk,
                num_max_tokens_per_rank=max(s.num_tokens for s in specs), dtype=cfg.dtype, backend=args.backend,
                deterministic=args.deterministic, timeout_s=args.timeout) as buf:
        timer, device, timer_name = _device_path(buf)
        meta = _meta(comm, cfg, args, specs[0], buf, timer_name)
        nccl = _gpu_extras(comm, args, timer, meta) if buf.backend == "nvshmem" else None
        row_bytes = cfg.hidden * payload_dtype(cfg.dtype).itemsize
        points = []
        for spec in specs:
            progress.start(f"{spec.num_tokens} tokens/rank", spec.warmup + spec.iters)
            sample, (x, routing) = run_point(comm, buf, spec, timer, device, progress.tick)
            if nccl is not None:
                sample.times.update(nccl(spec, x, routing.topk_idx))
            samples: Optional[List[RankSample]] = report.gather_samples(comm, sample)
            if is_root:
                points.append(report.summarize(samples, row_bytes))
                lat = points[-1]["latency_us"]
                progress.finish(f"{'ok' if points[-1]['check_passed'] else 'FAILED'}, dispatch p50 "
                                f"{lat['dispatch']['p50']:.1f} us, combine p50 {lat['combine']['p50']:.1f} us")
        if nccl is not None:
            from .baselines import close_torch_distributed

            close_torch_distributed()
    passed = all(p["check_passed"] for p in points) if is_root else None
    if is_root:
        _write_outputs(args, meta, points)
    return EXIT_OK if comm.bcast(passed, root=0) else EXIT_CHECK_FAILED
