"""Command line of the benchmark: ``mpirun -np N python -m ep_comm.bench --config NAME [options]``."""
from __future__ import annotations

import argparse
from typing import List, Optional

from ep_comm.bench.report import ALL_SMS
from ep_comm.bench.waits import straggler
from ep_comm.cli import ArgumentParser, exit_collectively, int_at_least, int_list, list_items
from ep_comm.contract.choices import BACKENDS, TRANSPORTS
from ep_comm.testing.routing import KINDS

token_list = int_list("token counts", 1, "128,512,4096")
SWEEP_TOKENS = [1, 16, 64, 128, 512, 4096]  # --sweep without a list: decode to prefill sizes


def sm_counts(text: str) -> List[Optional[int]]:
    """argparse type of ``--num-sms``: comma- or space-separated SM counts >= 1 or ``all``, each at most
    once; ``all`` becomes None (the Buffer's default: every SM of the device). ``"16,32,all"`` ->
    ``[16, 32, None]``."""
    items = list_items(text) or []
    rule = f"{text!r}: must be a list of distinct SM counts >= 1 or '{ALL_SMS}', e.g. 16,32,{ALL_SMS}"
    values: List[Optional[int]] = []
    for item in items:
        if item.lower() == ALL_SMS:
            values.append(None)
        elif item.isdigit() and int(item) >= 1:
            values.append(int(item))
        else:
            raise argparse.ArgumentTypeError(rule)
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(rule)
    return values


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m ep_comm.bench",
        description="Dispatch + combine benchmark with a round-trip check. Run under mpirun, one process per "
                    "rank (GPU). Exit status: 0 ok, 1 a round-trip or count check failed, 2 bad options/config, "
                    "an output path that cannot be written or no GPU stack for --backend nvshmem (all checked before "
                    "the run), 3 the results could not be written at the end.")
    p.add_argument("--config", default="cpu_demo",
                   help="config name in configs/ (ep_comm/configs/ in a wheel) or a path to a .toml (default: cpu_demo)")
    p.add_argument("--routing", choices=KINDS, help="routing generator (default: the config's routing.kind)")
    p.add_argument("--seed", type=int_at_least(0), help="routing/input seed (default: the config's routing.seed)")
    p.add_argument("--tokens", type=int_at_least(1), help="tokens per rank (default: the config's tokens_per_rank)")
    p.add_argument("--sweep", type=token_list, nargs="?", const=SWEEP_TOKENS, metavar="LIST",
                   help="one point per token count of LIST (comma-separated tokens per rank; without LIST "
                        f"{','.join(map(str, SWEEP_TOKENS))}), one after another on one Buffer sized for the largest; "
                        "the report ends with the sweep table (eager p50/p99 per operation, host us per call, first "
                        "call at each count) and the JSON gets a 'sweep' list. Counts above the config's "
                        "max_tokens_per_rank are refused")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timed iterations per point (default: 20)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed iterations per point (default: 3)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="ep_comm backend (default: auto)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="nvshmem backend: peer stores, nvshmem puts, or auto (stores in a node, puts between nodes), "
                        "Buffer(transport=...) (default: auto, the Buffer's default; stores are refused with "
                        "--scaleup-ranks of several nodes)")
    p.add_argument("--scaleup-ranks", type=int_at_least(1), metavar="N",
                   help="ranks per (virtual) node, Buffer(scaleup_ranks=N); N must divide the rank count (default: "
                        "one node of every rank). With several nodes, stores in a node and puts between them. Each "
                        "point's JSON gets 'link_model' and the report a table: per operation, rows and bytes per "
                        "token each rank sends over scale-up and scale-out, flat and forwarded, and the time at "
                        "NVLink 356 GB/s and RDMA 400 Gb/s per GPU next to the measured one (meta: scaleup_ranks, "
                        "num_nodes, link_rates_gbps)")
    p.add_argument("--forwarding", action="store_true",
                   help="Buffer(forwarding=True): a token crosses to another node once, to that node's forwarder, and "
                        "a combine is reduced in the node before it crosses back (needs --scaleup-ranks of several "
                        "nodes; the round trips are checked against the forwarded order's sums; meta: forwarding)")
    p.add_argument("--expand", action="store_true", help="expand dispatch (one row per token and local expert)")
    p.add_argument("--alignment", type=int_at_least(1), default=1, help="expert_alignment of expand mode (default: 1)")
    p.add_argument("--fp8", action="store_true",
                   help="the timed dispatches send x as an FP8 pair (ep_comm.contract.fp8.quantize, made once per point; the "
                        "config's hidden must be a multiple of 128); dispatch bytes count FP8 + scales per row; also "
                        "times the sender cast (use_fp8=True) as dispatch_cast; combine stays in the config's dtype")
    p.add_argument("--deterministic", action="store_true", help="Buffer(deterministic=True)")
    p.add_argument("--timeout", type=float, default=100.0, help="Buffer timeout_s in seconds (default: 100)")
    p.add_argument("--num-sms", type=sm_counts, default=[None], metavar="LIST",
                   help="SM counts for the GPU kernels, comma-separated, 'all' = every SM (Buffer(num_sms=None)); "
                        "every point runs once per count, on a Buffer of that count (default: all). The mpi "
                        "backend has no kernels: each count runs the same CPU path")
    p.add_argument("--no-baselines", action="store_true",
                   help="GPU: skip the NCCL baselines (skipped anyway when ranks share a GPU)")
    p.add_argument("--no-graphs", action="store_true",
                   help="GPU: skip the CUDA graph replays of the cached cpu_sync=False dispatch and its combine")
    p.add_argument("--busy-check", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU: per point, queue a 1 ms spin kernel, then a cached cpu_sync=False dispatch and its "
                        "combine; report the host time until both returned (hidden_sync: above 0.5 ms) and the GPU "
                        "total against 1 ms + the pair's graph replays (default: on; the mpi backend reports it "
                        "skipped)")
    p.add_argument("--straggler", type=straggler, metavar="RANK:US",
                   help="rank RANK sleeps US microseconds on the host before each of its calls (dispatch, combine, "
                        "CUDA-graph replay launch), every backend; every point's JSON gets 'wait_stats' (always, from "
                        "Buffer.wait_stats(): late_share and wait_us_p50 per rank) and the report names the rank that "
                        "made the others wait most")
    p.add_argument("--wait-stats", action=argparse.BooleanOptionalAction, default=True,
                   help="Buffer(wait_stats=...): measure every wait per peer (default: on; --no-wait-stats compares "
                        "the cost; the points then carry no 'wait_stats')")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per point")
    p.add_argument("--plot", metavar="PATH", help="plot bandwidth and latency vs tokens (needs matplotlib)")
    p.add_argument("--host-profile", metavar="PATH",
                   help="rank 0: profile the host side of the cached cpu_sync=False dispatch and combine calls "
                        "(the host_us figures) with cProfile and write the functions by cumulative time to PATH")
    p.add_argument("--progress", action="store_true",
                   help="force the live progress line (mpirun usually pipes stderr, so rank 0 sees no TTY)")
    p.add_argument("--quiet", action="store_true", help="no progress line and no report (failures still print)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the options and run the benchmark on MPI.COMM_WORLD; returns the exit status."""
    args = parser().parse_args(argv)
    if args.tokens and args.sweep:
        parser().error("give --tokens or --sweep, not both")
    if args.alignment != 1 and not args.expand:
        parser().error(f"--alignment {args.alignment}: applies to expand mode only, give --expand too "
                       "(compact dispatch has no expert blocks to align)")
    from ep_comm.bench.runner import run

    return run(args)


if __name__ == "__main__":
    exit_collectively(main)
