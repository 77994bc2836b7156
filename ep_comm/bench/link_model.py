"""``--scaleup-ranks N``: the byte model of each point's routing on nodes of N ranks (``ep_comm.contract.traffic``)
next to the measured times: per operation, rows and bytes per token each rank sends over scale-up and scale-out,
flat and forwarded (the forwarded combine reduced in the node: one scale-out row per token and remote node, as the
forwarded dispatch), forwarded over flat, and the model time at the link rates of ``meta["link_rates_gbps"]``.

The model counts what the routing implies; the run itself sends as the Buffer does (today: flat, every row
through puts once there are several nodes). Per token = a rank's rows over its own tokens (every rank of a point
has the same count); ``mean`` over ranks is then all rows over all tokens.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import numpy as np
from mpi4py import MPI

from ep_comm.contract import traffic
from ep_comm.contract.topology import Topology


def link_meta(topology: Topology, routing: str, num_experts: int, num_topk: int) -> Dict[str, Any]:
    """The ``meta`` fields of ``--scaleup-ranks``: ``scaleup_ranks``, ``num_nodes``, ``link_rates_gbps`` (GB/s per
    GPU) and, for uniform routing, ``uniform_expectation`` (``traffic.uniform_expectation``: expected rows per
    token)."""
    meta: Dict[str, Any] = {"scaleup_ranks": topology.scaleup_ranks, "num_nodes": topology.num_nodes,
                            "link_rates_gbps": dict(traffic.LINK_RATES_GBPS)}
    if routing == "uniform":
        expected = traffic.uniform_expectation(num_experts, num_topk, topology.num_ranks, topology.scaleup_ranks)
        meta["uniform_expectation"] = expected._asdict()
    return meta


def reduced_rows(comm: MPI.Comm, topk_idx: np.ndarray, num_experts: int, topology: Topology) -> Optional[np.ndarray]:
    """``traffic.sent_rows`` of this rank's routing summed over the ranks of ``comm`` onto rank 0 (None elsewhere).
    Collective."""
    rows = traffic.sent_rows(topk_idx, comm.rank, num_experts, topology)
    total = np.zeros_like(rows) if comm.rank == 0 else None
    comm.Reduce(rows, total, op=MPI.SUM, root=0)
    return total


def _per_token(rows: np.ndarray, num_tokens: int, row_bytes: int) -> Dict[str, Any]:
    per_token = rows / num_tokens if num_tokens else np.zeros(len(rows))
    return {"rows_per_token": per_token.tolist(), "rows_per_token_max": float(per_token.max()),
            "rows_per_token_mean": float(per_token.mean()), "bytes_per_token": (per_token * row_bytes).tolist(),
            "bytes_per_token_max": float(per_token.max() * row_bytes),
            "bytes_per_token_mean": float(per_token.mean() * row_bytes)}


def section(rows: np.ndarray, num_tokens: int, row_bytes: Mapping[str, int],
            latency: Mapping[str, Any]) -> Dict[str, Any]:
    """The point's ``link_model``: per operation of ``traffic.OPS``, per route ``{"scaleup": ..., "scaleout": ...,
    "model_us": ...}`` with each link's rows and bytes per token per rank (lists) and their max and mean,
    ``forwarded_over_flat`` (mean scale-out and scale-up bytes per token, model time), ``row_bytes`` and
    ``measured_p50_us`` (the point's slowest-rank p50).

    Args:
        rows: int64 ``[OPS, ROUTES, LINKS, R]`` of :func:`reduced_rows`.
        num_tokens: tokens per rank.
        row_bytes: bytes per row of each operation (``ep_comm.bench.runner.row_bytes``).
        latency: the point's ``latency_us``.
    """
    out: Dict[str, Any] = {}
    for i, op in enumerate(traffic.OPS):
        entry: Dict[str, Any] = {"row_bytes": int(row_bytes[op]), "measured_p50_us": latency[op]["p50"]}
        for j, route in enumerate(traffic.ROUTES):
            links = {link: _per_token(rows[i, j, k], num_tokens, row_bytes[op]) for k, link in enumerate(traffic.LINKS)}
            nbytes = rows[i, j] * row_bytes[op]
            entry[route] = {**links, "model_us": traffic.model_time_s(nbytes[0], nbytes[1]) * 1e6}
        flat, forwarded = entry["flat"], entry["forwarded"]
        entry["forwarded_over_flat"] = {
            f"{link}_bytes": _ratio(forwarded[link]["bytes_per_token_mean"], flat[link]["bytes_per_token_mean"])
            for link in traffic.LINKS}
        entry["forwarded_over_flat"]["model_us"] = _ratio(forwarded["model_us"], flat["model_us"])
        out[op] = entry
    return out


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def format_lines(model: Optional[Dict[str, Any]]) -> List[str]:
    """The report's table of a point's ``link_model`` (none without one): rows per token over each link (mean over
    ranks, max in brackets), scale-out KB per token, model time and the measured p50."""
    if not model:
        return []
    lines = ["  link model (rows/token sent per rank: mean (max); model: slowest link at meta's link_rates_gbps):",
             f"    {'op':<8} {'route':<9} {'scale-up rows':>15} {'scale-out rows':>15} {'scale-out KB':>12} "
             f"{'model us':>10} {'measured p50 us':>15}"]
    for op in traffic.OPS:
        entry = model[op]
        for route in traffic.ROUTES:
            up, out = entry[route]["scaleup"], entry[route]["scaleout"]
            lines.append(f"    {op:<8} {route:<9} {_mean_max(up):>15} {_mean_max(out):>15} "
                         f"{out['bytes_per_token_mean'] / 1e3:>12.2f} {entry[route]['model_us']:>10.1f} "
                         f"{entry['measured_p50_us']:>15.1f}")
        ratio = entry["forwarded_over_flat"]["scaleout_bytes"]
        lines.append(f"    {op:<8} forwarded/flat scale-out bytes: " + ("-" if ratio is None else f"{ratio:.3f}"))
    return lines


def _mean_max(link: Mapping[str, Any]) -> str:
    return f"{link['rows_per_token_mean']:.3f} ({link['rows_per_token_max']:.3f})"
