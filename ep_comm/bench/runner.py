"""The benchmark run: a Buffer per SM count of ``--num-sms``, every point on each (and the GPU
baselines), report on rank 0. On the ``mpi`` backend the SM counts have no effect (no kernels): each
count runs the same CPU path, and the report says so.

Every rank runs :func:`run` with the same options; decisions that could differ between ranks
(a missing optional package) are taken on rank 0 and broadcast, so all ranks stop together.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm import Buffer
from ep_comm.bench import eager, link_model, provenance, report, shared_gpu
from ep_comm.bench.config import Config, ConfigError, load_config
from ep_comm.bench.measure import PointSpec, RankSample, cuda_timer, host_timer
from ep_comm.bench.point import buffer_tokens, prime, primed_spec, run_point
from ep_comm.cli import EXIT_USAGE, environment_problem, output_problem
from ep_comm.cli.versions import versions
from ep_comm.contract import fp8
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.topology import Topology

EXIT_OK, EXIT_CHECK_FAILED, EXIT_OUTPUT_FAILED = 0, 1, 3


class UsageError(Exception):
    """The options and config cannot run on this communicator; the message says why."""


def _point_specs(cfg: Config, args: argparse.Namespace) -> List[PointSpec]:
    tokens = args.sweep or [args.tokens or cfg.tokens_per_rank]
    return [PointSpec(cfg.num_experts, cfg.hidden, cfg.num_topk, t, cfg.dtype,
                      routing=args.routing or cfg.routing.kind,
                      seed=cfg.routing.seed if args.seed is None else args.seed,
                      zipf_s=cfg.routing.zipf_s, hot_expert=cfg.routing.hot_expert, expand=args.expand,
                      expert_alignment=args.alignment, warmup=args.warmup, iters=args.iters, fp8=args.fp8,
                      forwarded_nodes=args.scaleup_ranks if args.forwarding else None)
            for t in tokens]


def _outputs_problem(args: argparse.Namespace) -> Optional[str]:
    """Why one of ``--json``, ``--csv``, ``--plot``, ``--host-profile`` cannot be written (parent directories are
    created), or None."""
    for option, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot),
                         ("--host-profile", args.host_profile)):
        problem = output_problem(option, path)
        if problem:
            return problem
    return None


def _tokens_problem(cfg: Config, args: argparse.Namespace) -> Optional[str]:
    """Why ``--tokens`` or ``--sweep`` asks for more tokens per rank than the config's ``max_tokens_per_rank``,
    or None."""
    for option, values in (("--tokens", [args.tokens] if args.tokens else []), ("--sweep", args.sweep or [])):
        over = [t for t in values if t > cfg.max_tokens_per_rank]
        if over:
            return (f"{option} {','.join(map(str, values))}: {over[0]} tokens per rank is above max_tokens_per_rank = "
                    f"{cfg.max_tokens_per_rank} of config {cfg.name} (the most a run of this shape asks for; set "
                    "max_tokens_per_rank in the config to go higher)")
    return None


def _load(comm: MPI.Comm, args: argparse.Namespace) -> Config:
    """The config, once the environment, the config's fit to ``comm`` (and ``--scaleup-ranks``'s) and the output
    paths are checked (a UsageError, the same on every rank, otherwise)."""
    problem = environment_problem(comm, args.backend)
    if problem:
        raise UsageError(problem)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    problem = _tokens_problem(cfg, args)
    if problem:
        raise UsageError(problem)
    if args.fp8 and cfg.hidden % fp8.BLOCK:
        raise UsageError(f"--fp8: config {cfg.name} has hidden = {cfg.hidden}: FP8 needs hidden a multiple of "
                         f"{fp8.BLOCK} (one float32 scale per {fp8.BLOCK}-element block); use a config whose is")
    if args.straggler is not None and args.straggler.rank >= comm.size:
        raise UsageError(f"--straggler {args.straggler.rank}:{args.straggler.us:g}: rank {args.straggler.rank} is not "
                         f"a rank of this run of {comm.size}")
    if cfg.num_experts % comm.size:
        raise UsageError(f"config {cfg.name}: num_experts = {cfg.num_experts} is not divisible by the "
                         f"{comm.size} ranks of this run (experts are split evenly over ranks)")
    try:
        nodes = Topology.of(comm.size, args.scaleup_ranks).num_nodes
    except ValueError as exc:
        raise UsageError(f"--scaleup-ranks: {exc}") from exc
    if args.forwarding and nodes < 2:
        raise UsageError(f"--forwarding: the {comm.size} ranks of this run are one node (--scaleup-ranks "
                         f"{args.scaleup_ranks or 'not given'}), where nothing is forwarded; give --scaleup-ranks N "
                         "with N < the rank count")
    if args.plot:
        missing = comm.bcast(report.matplotlib_missing() if comm.rank == 0 else None, root=0)
        if missing:
            raise UsageError(missing)
    problem = comm.bcast(_outputs_problem(args) if comm.rank == 0 else None, root=0)
    if problem:
        raise UsageError(problem)
    return cfg


class DevicePath(NamedTuple):
    """How a run on one backend times and feeds its calls, and which GPU this rank uses."""

    timer: Callable
    to_device: Callable[[np.ndarray], Any]  # host array -> an array of the backend
    timer_name: str
    gpu_id: Optional[str]  # PCI bus id of this rank's GPU, None on the mpi backend


def _device_path(buf: Buffer) -> DevicePath:
    """The :class:`DevicePath` of the buffer's backend (on nvshmem: CuPy's current device, the Buffer's)."""
    if buf.backend == "nvshmem":
        import cupy

        return DevicePath(cuda_timer, cupy.asarray, "CUDA events", cupy.cuda.Device().pci_bus_id)
    return DevicePath(host_timer, lambda a: a, "host wall-clock", None)


def _nvlink_ceiling(comm: MPI.Comm, timer: Callable, meta: Dict[str, Any]) -> None:
    """Measure the NVLink ceiling into ``meta`` (None and the error when it cannot be measured)."""
    from ep_comm.bench import baselines

    try:
        ceiling = baselines.nvlink_ceiling(comm, baselines.nvshmem_peer_view, timer)
        meta["nvlink_ceiling_gbps"] = float(np.mean(comm.allgather(ceiling)))
    except Exception as exc:  # the ceiling is context, not the product: report why it is missing
        meta["nvlink_ceiling_gbps"] = None
        meta["nvlink_ceiling_error"] = f"{type(exc).__name__}: {exc}"


def _gpu_extras(comm: MPI.Comm, args: argparse.Namespace, timer: Callable, meta: Dict[str, Any],
                shared: bool) -> Optional[Callable]:
    """On the GPU path: measure the NVLink ceiling into ``meta`` and return the per-point NCCL
    baseline runner, or None when ``--no-baselines``, torch is missing or ranks share a GPU
    (``shared``: neither NCCL nor the ceiling is measured then; noted in ``meta``)."""
    from ep_comm.bench import baselines

    if shared:
        meta["nvlink_ceiling_gbps"] = None
        meta["nvlink_ceiling"] = shared_gpu.CEILING_SKIPPED
    else:
        _nvlink_ceiling(comm, timer, meta)
    if args.no_baselines:
        return None
    if shared:
        meta["baselines"] = shared_gpu.BASELINES_SKIPPED
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        meta["baselines"] = "skipped: torch is not installed"
        return None

    def nccl(spec: PointSpec, x: np.ndarray, topk_idx: np.ndarray) -> Dict[str, List[float]]:
        return baselines.time_nccl_baselines(comm, x, topk_idx, spec.num_experts, spec.warmup, spec.iters, timer)

    return nccl


def row_bytes(cfg: Config, use_fp8: bool) -> Dict[str, int]:
    """Bytes counted per received row: ``{"dispatch": n, "combine": hidden * itemsize}``; the dispatch's are
    ``hidden * itemsize`` too, or with ``use_fp8`` the FP8 bytes and scales (``ep_comm.contract.fp8.row_bytes``: the
    packed row's padding to 16 bytes is not counted)."""
    combine = cfg.hidden * payload_dtype(cfg.dtype).itemsize
    return {"dispatch": fp8.row_bytes(cfg.hidden) if use_fp8 else combine, "combine": combine}


def _fp8_meta(cfg: Config, use_fp8: bool) -> Dict[str, Any]:
    """The ``meta`` fields of ``--fp8``: the flag, the bytes counted per row and, with FP8, what they are."""
    meta: Dict[str, Any] = {"fp8": use_fp8, "row_bytes": row_bytes(cfg, use_fp8)}
    if use_fp8:
        h = cfg.hidden
        meta["fp8_bytes"] = (f"dispatch rows counted as {fp8.row_bytes(h)} bytes: {h} FP8 + {h // 32} scale bytes; "
                             f"the packed row on the link is {fp8.packed_row_bytes(h)} (padding to 16 not counted)")
    return meta


def _meta(comm: MPI.Comm, cfg: Config, args: argparse.Namespace, specs: List[PointSpec], buf: Buffer,
          path: DevicePath, shared: bool) -> Dict[str, Any]:
    """The run's parameters and provenance: the git commit when ep_comm runs from a clean checkout (else why not),
    the package versions, on GPU rank 0's GPU model and driver; ``transport`` as asked and ``transport_in_effect``
    (``Buffer.transport``: the mix, None on mpi); ``prime_tokens``, the token count of each Buffer's priming round
    trip."""
    spec = specs[0]
    meta = {
        "config": cfg.name, "backend": buf.backend, "transport": args.transport,
        "transport_in_effect": buf.transport, "ranks": comm.size,
        "routing": spec.routing, "seed": spec.seed, "dtype": cfg.dtype, "hidden": cfg.hidden,
        "num_experts": cfg.num_experts, "num_topk": cfg.num_topk, "mode": "expand" if args.expand else "compact",
        "expert_alignment": args.alignment, "deterministic": args.deterministic, "iters": args.iters,
        "warmup": args.warmup, "timer": path.timer_name, "num_sms": ",".join(report.sms_label(n) for n in args.num_sms),
        "prime_tokens": primed_spec(specs).num_tokens, "busy_check": args.busy_check,
        "shared_gpu": shared, **provenance.git_commit(), "versions": versions(),
        "command": provenance.command_line(comm.size), **_fp8_meta(cfg, args.fp8),
        "straggler": None if args.straggler is None else {"rank": args.straggler.rank, "us": args.straggler.us},
        "wait_stats": args.wait_stats, "forwarding": args.forwarding,
    }
    if args.scaleup_ranks:
        meta.update(link_model.link_meta(Topology.of(comm.size, args.scaleup_ranks), spec.routing, cfg.num_experts,
                                         cfg.num_topk))
    if path.gpu_id is not None:
        meta["gpu"] = provenance.gpu_model(path.gpu_id)
    if shared:
        meta["note"] = shared_gpu.NOTE
    return meta


def _write_host_profile(path: str, profiler: cProfile.Profile, meta: Dict[str, Any]) -> None:
    """The ``--host-profile`` file: what was profiled, then cProfile's functions by cumulative time."""
    with open(path, "w") as f:
        f.write(f"cProfile of rank 0's host calls (cached dispatch cpu_sync=False + combine, {meta['warmup']} + "
                f"{meta['iters']} rounds per point; no device waits): {meta.get('command', '')}\n")
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("cumulative").print_stats(80)
        f.write("By own time (where the time is spent, not what calls it):\n")
        stats.sort_stats("tottime").print_stats(60)


def _write_outputs(args: argparse.Namespace, meta: Dict[str, Any], points: List[Dict[str, Any]],
                   profiler: Optional[cProfile.Profile] = None) -> None:
    """Rank 0, after the run: the failures when ``--quiet`` (the report printed them otherwise), the files."""
    if args.quiet:
        for point in points:
            for failure in point["failures"]:
                print(f"ep_comm.bench: {report.point_title(point)}: FAILED {failure}", file=sys.stderr)
    if args.json:
        report.write_json(args.json, meta, points, eager.sweep_sections(points, args.sweep is not None))
    if args.csv:
        report.write_csv(args.csv, points)
    if args.plot:
        report.write_plot(args.plot, meta, points)
    if profiler is not None:
        _write_host_profile(args.host_profile, profiler, meta)


def _open_buffer(comm: MPI.Comm, cfg: Config, args: argparse.Namespace, specs: List[PointSpec],
                 num_sms: Optional[int]) -> Buffer:
    """The Buffer of one SM count (None: all), sized for the largest point; a ValueError of its
    constructor (e.g. ``num_sms`` above the GPU's SM count, raised on every rank) is a UsageError."""
    try:
        return Buffer(comm, num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk,
                      num_max_tokens_per_rank=buffer_tokens(specs), dtype=cfg.dtype,
                      backend=args.backend, deterministic=args.deterministic, timeout_s=args.timeout, num_sms=num_sms,
                      transport=args.transport, scaleup_ranks=args.scaleup_ranks, forwarding=args.forwarding,
                      wait_stats=args.wait_stats)
    except ValueError as exc:
        raise UsageError(f"cannot build the Buffer for num_sms={report.sms_label(num_sms)}: {exc}") from exc


class _Session:
    """What every Buffer of a run shares: timer, host->device copy, whether ranks share a GPU, NCCL
    baselines, meta and points."""

    def __init__(self, comm: MPI.Comm, cfg: Config, args: argparse.Namespace, specs: List[PointSpec],
                 progress: report.Progress):
        self.comm, self.cfg, self.args, self.specs, self.progress = comm, cfg, args, specs, progress
        self.meta: Dict[str, Any] = {}
        self.points: List[Dict[str, Any]] = []
        self.nccl: Optional[Callable] = None
        self.timer: Callable = host_timer
        self.device: Callable[[np.ndarray], Any] = lambda a: a
        self.shared_gpu = False
        self.shown = comm.rank == 0 and not args.quiet  # rank 0 prints the report as the run goes
        self.profiler = cProfile.Profile() if args.host_profile and comm.rank == 0 else None
        self.topology = Topology.of(comm.size, args.scaleup_ranks) if args.scaleup_ranks else None
        self.pause = None if args.straggler is None else args.straggler.pause_for(comm.rank)

    def start(self, buf: Buffer) -> None:
        """On the first Buffer (collective): pick the timer, find out whether ranks share a GPU, fill
        ``meta``, measure the GPU extras."""
        path = _device_path(buf)
        self.timer, self.device = path.timer, path.to_device
        self.shared_gpu = shared_gpu.ranks_share_a_gpu(self.comm, path.gpu_id)
        self.meta = _meta(self.comm, self.cfg, self.args, self.specs, buf, path, self.shared_gpu)
        if self.shared_gpu and self.comm.rank == 0 and not self.args.quiet:
            print(shared_gpu.skip_line(self.args.no_baselines), file=sys.stderr, flush=True)
        if buf.backend == "nvshmem":
            self.nccl = _gpu_extras(self.comm, self.args, self.timer, self.meta, self.shared_gpu)
        if self.shown:
            print(report.format_header(self.meta), flush=True)

    def run_points(self, buf: Buffer, num_sms: Optional[int]) -> None:
        """Every point on ``buf`` (SM count ``num_sms`` as asked); rank 0 keeps the summaries."""
        per_row = row_bytes(self.cfg, self.args.fp8)
        primed = prime(buf, primed_spec(self.specs), self.timer, self.device, self.comm.rank)
        for spec in self.specs:
            self.progress.start(f"{spec.num_tokens} tokens/rank, num_sms={report.sms_label(num_sms)}",
                                spec.warmup + spec.iters)
            sample, (rows, routing) = run_point(self.comm, buf, spec, self.timer, self.device, self.progress.tick,
                                             graphs=buf.backend == "nvshmem" and not self.args.no_graphs,
                                             busy_check=self.args.busy_check, profiler=self.profiler,
                                             pause=self.pause)
            sample.first_round_trip_s = primed  # the Buffer's first round trip, before its first point
            if self.nccl is not None:
                sample.times.update(self.nccl(spec, rows, routing.topk_idx))
            if buf.backend == "nvshmem":
                sample.times.update(_device_copies(self.comm, spec, sample.recv_rows, per_row, self.timer))
            samples: Optional[List[RankSample]] = report.gather_samples(self.comm, sample)
            links, counted = ((link_model.reduced_rows(self.comm, routing.topk_idx, spec.num_experts, self.topology),
                               link_model.counted_rows(self.comm, buf, spec, self.device))
                              if self.topology else (None, None))
            if self.comm.rank == 0:
                self.points.append(report.summarize(samples, per_row, num_sms, buf.num_sms, self.shared_gpu))
                if links is not None:
                    self.points[-1]["link_model"] = link_model.section(links, spec.num_tokens, per_row,
                                                                       self.points[-1]["latency_us"], counted)
                self.progress.finish(_summary_line(self.points[-1]))
                if self.shown:
                    print(report.format_point(self.points[-1], self.meta.get("nvlink_ceiling_gbps")), flush=True)

    def finish(self) -> None:
        """After the last point: the end of the report (rank 0), the NCCL baselines closed."""
        tail = report.format_tail(self.points)
        if self.shown and tail:
            print(tail, flush=True)
        self.close()

    def close(self) -> None:
        if self.nccl is not None:
            from ep_comm.bench.baselines import close_torch_distributed

            close_torch_distributed()


def _device_copies(comm: MPI.Comm, spec: PointSpec, recv_rows: int, per_row: Dict[str, int],
                   timer: Callable) -> Dict[str, List[float]]:
    """The same-run references of a point: seconds per device copy of the bytes its dispatch delivers to this
    rank (``device_copy``: ``recv_rows * per_row["dispatch"]``, the FP8 bytes with ``--fp8``) and, where the
    combine's row bytes differ (``--fp8``), of the combine's (``device_copy_combine``)."""
    from ep_comm.bench.baselines import device_copy_times

    copies = {"device_copy": per_row["dispatch"]}
    if per_row["combine"] != per_row["dispatch"]:
        copies[report.COMBINE_COPY] = per_row["combine"]
    return {name: device_copy_times(comm, recv_rows * nbytes, spec.warmup, spec.iters, timer)
            for name, nbytes in copies.items()}


def _summary_line(point: Dict[str, Any]) -> str:
    """The one line per point: check, SMs in effect, dispatch and combine p50/p99 of the slowest rank."""
    lat = point["latency_us"]
    used, asked = point["num_sms_in_effect"], point["num_sms"]
    sms = f"{used} SMs, " if used is not None else ("" if asked == report.ALL_SMS else "no effect on mpi, ")
    return (f"{'ok' if point['check_passed'] else 'FAILED'}, {sms}dispatch p50/p99 {lat['dispatch']['p50']:.1f}/"
            f"{lat['dispatch']['p99']:.1f} us, combine p50/p99 {lat['combine']['p50']:.1f}/"
            f"{lat['combine']['p99']:.1f} us")


def _measure(comm: MPI.Comm, cfg: Config, args: argparse.Namespace, specs: List[PointSpec],
             progress: report.Progress) -> Tuple[Dict[str, Any], List[Dict[str, Any]], Optional[cProfile.Profile]]:
    """Every point once per SM count of ``--num-sms``, each count on its own Buffer, in the order given;
    returns ``(meta, points, host profiler)`` (points and the ``--host-profile`` profiler on rank 0 only)."""
    session = _Session(comm, cfg, args, specs, progress)
    try:
        for num_sms in args.num_sms:
            with _open_buffer(comm, cfg, args, specs, num_sms) as buf:
                if not session.meta:
                    session.start(buf)
                session.run_points(buf, num_sms)
    except UsageError:  # raised on every rank alike: the collective teardown is safe
        session.close()
        raise
    session.finish()
    return session.meta, session.points, session.profiler


def run(args: argparse.Namespace, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Run the benchmark the options describe; every rank returns the same exit code."""
    is_root = comm.rank == 0
    try:
        cfg = _load(comm, args)
        specs = _point_specs(cfg, args)
        shown = is_root and not args.quiet
        progress = report.Progress(live=shown and (args.progress or sys.stderr.isatty()), final=shown)
        meta, points, profiler = _measure(comm, cfg, args, specs, progress)
    except UsageError as exc:
        if is_root:
            print(f"ep_comm.bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    verdict = None
    if is_root:
        verdict = EXIT_OK if all(p["check_passed"] for p in points) else EXIT_CHECK_FAILED
        try:
            _write_outputs(args, meta, points, profiler)
        except Exception:  # the other ranks wait for the verdict: report, never leave them hanging
            traceback.print_exc()
            print("ep_comm.bench: writing the results failed (see above)", file=sys.stderr)
            verdict = EXIT_OUTPUT_FAILED
    return comm.bcast(verdict, root=0)
