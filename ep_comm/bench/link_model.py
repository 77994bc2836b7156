"""``--scaleup-ranks N``: the byte model of each point's routing on nodes of N ranks (``ep_comm.contract.traffic``)
next to the measured times: per operation, rows and bytes per token each rank sends over scale-up and scale-out,
flat and forwarded (the forwarded combine reduced in the node: one scale-out row per token and remote node, as the
forwarded dispatch), forwarded over flat, and the model time at the link rates of ``meta["link_rates_gbps"]``.

The model counts what the routing implies; the run itself sends as the Buffer does (today: flat, every row
through puts once there are several nodes), and the rows the Buffer counted over scale-out
(``Buffer.traffic()``; ``nvshmem``: on the device) in one round trip of the point go next to the model
(``counted_scaleout``). Per token = a rank's rows over its own tokens (every rank of a point
has the same count); ``mean`` over ranks is then all rows over all tokens.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ep_comm.bench.measure import make_inputs
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


def counted_rows(comm: MPI.Comm, buf: Any, spec: Any, device: Callable[[np.ndarray], Any]) -> Optional[List[List[int]]]:
    """The rows each rank put over the scale-out path (``Buffer.traffic()``) in one untimed plain round trip of the
    point's inputs (``spec``, a ``PointSpec``: no FP8, no weights), ``[R][OPS]`` on rank 0 (None elsewhere).
    Collective."""
    x, routing = make_inputs(spec, comm.rank)
    before = buf.traffic().scaleout_rows
    out = buf.dispatch(device(x), device(routing.topk_idx), expand=spec.expand,
                       expert_alignment=spec.expert_alignment)
    buf.combine(out.recv_x, out.handle)
    after = buf.traffic().scaleout_rows
    return comm.gather([after[i] - before[i] for i in range(len(traffic.OPS))], root=0)


def _per_token(rows: np.ndarray, num_tokens: int, row_bytes: int) -> Dict[str, Any]:
    per_token = rows / num_tokens if num_tokens else np.zeros(len(rows))
    return {"rows_per_token": per_token.tolist(), "rows_per_token_max": float(per_token.max()),
            "rows_per_token_mean": float(per_token.mean()), "bytes_per_token": (per_token * row_bytes).tolist(),
            "bytes_per_token_max": float(per_token.max() * row_bytes),
            "bytes_per_token_mean": float(per_token.mean() * row_bytes)}


def section(rows: np.ndarray, num_tokens: int, row_bytes: Mapping[str, int], latency: Mapping[str, Any],
            counted: Optional[Sequence[Sequence[int]]] = None) -> Dict[str, Any]:
    """The point's ``link_model``: per operation of ``traffic.OPS``, per route ``{"scaleup": ..., "scaleout": ...,
    "model_us": ...}`` with each link's rows and bytes per token per rank (lists) and their max and mean,
    ``forwarded_over_flat`` (mean scale-out and scale-up bytes per token, model time), ``row_bytes``,
    ``measured_p50_us`` (the point's slowest-rank p50) and ``counted_scaleout`` (the rows and bytes per token the
    Buffer counted, as a link's, or None).

    Args:
        rows: int64 ``[OPS, ROUTES, LINKS, R]`` of :func:`reduced_rows`.
        num_tokens: tokens per rank.
        row_bytes: bytes per row of each operation (``ep_comm.bench.runner.row_bytes``).
        latency: the point's ``latency_us``.
        counted: :func:`counted_rows`, ``[R][OPS]``, or None.
    """
    out: Dict[str, Any] = {}
    for i, op in enumerate(traffic.OPS):
        entry: Dict[str, Any] = {"row_bytes": int(row_bytes[op]), "measured_p50_us": latency[op]["p50"],
                                 "counted_scaleout": None if counted is None else _per_token(
                                     np.array([rank[i] for rank in counted]), num_tokens, row_bytes[op])}
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


def csv_columns(model: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The CSV columns of a point's ``link_model`` (none without one), per operation: per route the mean rows per
    token over each link, the mean scale-out bytes per token and the model time; the forwarded/flat scale-out bytes
    and the scale-out rows per token the Buffer counted (mean; ``""`` where either is None)."""
    if not model:
        return {}
    row: Dict[str, Any] = {}
    for op in traffic.OPS:
        entry = model[op]
        for route in traffic.ROUTES:
            for link in traffic.LINKS:
                row[f"link_{op}_{route}_{link}_rows_per_token"] = entry[route][link]["rows_per_token_mean"]
            row[f"link_{op}_{route}_scaleout_bytes_per_token"] = entry[route]["scaleout"]["bytes_per_token_mean"]
            row[f"link_{op}_{route}_model_us"] = entry[route]["model_us"]
        ratio, counted = entry["forwarded_over_flat"]["scaleout_bytes"], entry["counted_scaleout"]
        row[f"link_{op}_forwarded_over_flat_scaleout_bytes"] = "" if ratio is None else ratio
        row[f"link_{op}_counted_scaleout_rows_per_token"] = "" if counted is None else counted["rows_per_token_mean"]
    return row


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
        if entry["counted_scaleout"] is not None:
            lines.append(f"    {op:<8} scale-out rows the Buffer counted (Buffer.traffic): "
                         f"{_mean_max(entry['counted_scaleout'])}")
    return lines


def _mean_max(link: Mapping[str, Any]) -> str:
    return f"{link['rows_per_token_mean']:.3f} ({link['rows_per_token_max']:.3f})"
