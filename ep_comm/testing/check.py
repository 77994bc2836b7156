"""The one dispatch/combine checker: a rank's outputs against the NumPy reference (``ep_comm.contract.layout``,
``ep_comm.contract.reduce``), for compact and expand dispatch, deterministic or not.

Every check returns the problems it found, one line each (empty: passed), so that a caller can
report them (soak, bench), gather them over ranks or assert on them (tests). The receiver's
expected rows come from every rank's inputs (:class:`Sources`): each (token, rank) and
(token, local expert) pair exactly once, byte-exact, grouped by source rank, in (source rank,
source token) order when deterministic; counts, handle fields and metadata as the contract says;
combine bit for bit in the contract's float32 order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.contract import layout as lay
from ep_comm.contract.arrays import to_host
from ep_comm.testing.forwarded import Forwarded
from ep_comm.testing.round_trip import SentBack, expected_round_trip, first_mismatch


@dataclass(frozen=True)
class Sources:
    """Every rank's inputs of one dispatch (index = source rank): what the receivers are checked against."""

    num_experts: int
    max_tokens: int  # num_max_tokens_per_rank of the Buffer
    topk_idx: Sequence[np.ndarray]  # [T_r, K] integer global expert ids, -1 = no expert
    x: Sequence[np.ndarray]  # [T_r, H] payload
    weights: Sequence[Optional[np.ndarray]]  # [T_r, K] float32, or None where no weights exist

    @property
    def num_ranks(self) -> int:
        return len(self.topk_idx)

    @property
    def num_local(self) -> int:
        """Experts per rank."""
        return self.num_experts // self.num_ranks

    def weights_of(self, rank: int) -> np.ndarray:
        """``[T_r, K]`` float32 weights of ``rank`` (zeros where it has none)."""
        w = self.weights[rank]
        return np.zeros(self.topk_idx[rank].shape, np.float32) if w is None else w


@dataclass(frozen=True)
class DispatchOptions:
    """The arguments of the dispatch (and Buffer) being checked."""

    expand: bool = False
    alignment: int = 1
    zero_padding: bool = False
    cpu_sync: bool = True
    weighted: bool = False  # topk_weights were dispatched (and given to the combine)
    deterministic: bool = False
    forwarded_scaleup_ranks: Optional[int] = None  # scaleup_ranks of a Buffer that forwards (several nodes)


@dataclass
class HostDispatch:
    """Host copies of a dispatch's outputs (``N`` compact rows, ``rows`` = rows of ``recv_x``)."""

    recv_x: np.ndarray  # [rows, H] payload
    recv_idx: np.ndarray  # [rows, K] compact, [rows] expand
    recv_w: Optional[np.ndarray]  # float32, shaped like recv_idx
    meta: np.ndarray  # [N or worst case, 2+K] int32
    psum_rank: np.ndarray  # [R]
    psum_expert: np.ndarray  # [L]
    aligned: np.ndarray  # [L]
    unaligned: np.ndarray  # [L]
    num_recv: int
    num_expanded: int

    @classmethod
    def of(cls, out: Any) -> "HostDispatch":
        """Copy a ``DispatchOutput`` (NumPy or CuPy arrays) to the host."""
        h = out.handle
        return cls(to_host(out.recv_x), to_host(out.recv_topk_idx),
                   None if out.recv_topk_weights is None else to_host(out.recv_topk_weights),
                   to_host(h.recv_src_metadata), to_host(h.psum_num_recv_tokens_per_rank),
                   to_host(h.psum_num_recv_tokens_per_expert), np.asarray(to_host(h.num_recv_tokens_per_expert)),
                   to_host(h.num_unaligned_recv_tokens_per_expert), int(to_host(h.num_recv_tokens)),
                   int(to_host(h.num_expanded_tokens)))


@dataclass
class Expected:
    """What one rank must receive in one dispatch, in ascending (source rank, source token) order."""

    counts: np.ndarray  # [R] rows from each source
    origin: np.ndarray  # [N] int64 src_rank * max_tokens + src_token (ascending)
    x: np.ndarray  # [N, H] payload rows
    local: np.ndarray  # [N, K] int64 local expert ids on the receiver, -1 elsewhere
    weights: np.ndarray  # [N, K] float32

    def reorder(self, pos: np.ndarray) -> "Expected":
        """The rows in the order ``pos`` (positions in this ascending order)."""
        return Expected(self.counts, self.origin[pos], self.x[pos], self.local[pos], self.weights[pos])

    def expert_counts(self, num_local: int) -> np.ndarray:
        """``[L]`` int64: unaligned rows of each local expert (its entries on this rank)."""
        return np.bincount(self.local[self.local >= 0], minlength=num_local).astype(np.int64)


def token_rows(out: Any) -> np.ndarray:
    """Indices of the rows of a dispatch's ``recv_x`` that hold a received token: the first ``num_recv_tokens``
    (compact), the first ``num_expanded_tokens`` whose ``recv_topk_idx`` is an expert (expand). The contract
    leaves the other rows' bytes unspecified (padding without ``zero_padding``, the worst-case rows past the
    received ones with ``cpu_sync=False``): on the GPU they hold whatever the allocation held."""
    handle = out.handle
    if not handle.expand:
        return np.arange(int(to_host(handle.num_recv_tokens)))
    rows = int(to_host(handle.num_expanded_tokens))
    return np.nonzero(to_host(out.recv_topk_idx)[:rows] >= 0)[0]


def same_bytes(a: Any, b: Any, xp: Any = np) -> bool:
    """Both None, or equal shapes and bytes; ``xp`` (NumPy or CuPy) compares where the arrays live."""
    if a is None or b is None:
        return a is None and b is None
    a, b = xp.asarray(a), xp.asarray(b)
    return a.shape == b.shape and bool(xp.array_equal(xp.ascontiguousarray(a).reshape(-1).view(xp.uint8),
                                                      xp.ascontiguousarray(b).reshape(-1).view(xp.uint8)))


def expected_receive(sources: Sources, me: int) -> Expected:
    """With ``ep_comm.contract.layout``, from every rank's inputs: the rows rank ``me`` receives (ascending order)."""
    num_ranks = sources.num_ranks
    sent = [np.nonzero(lay.is_token_in_rank(idx, sources.num_experts, num_ranks)[:, me])[0]
            for idx in sources.topk_idx]
    return Expected(
        counts=np.array([len(s) for s in sent], dtype=np.int64),
        origin=np.concatenate([r * sources.max_tokens + s for r, s in enumerate(sent)]).astype(np.int64),
        x=np.concatenate([p[s] for p, s in zip(sources.x, sent)]),
        local=np.concatenate([lay.local_topk(np.asarray(idx, np.int64)[s], me, sources.num_local)
                              for idx, s in zip(sources.topk_idx, sent)]).astype(np.int64),
        weights=np.concatenate([sources.weights_of(r)[s] for r, s in enumerate(sent)]),
    )


def match_rows(want: Expected, got: HostDispatch, max_tokens: int, deterministic: bool
               ) -> Tuple[Optional[np.ndarray], List[str]]:
    """``(positions in want of the received rows, problems)``: every (token, rank) pair exactly once,
    grouped by source rank, in order when deterministic. Positions are None when they cannot be matched."""
    n = int(want.counts.sum())
    if not np.array_equal(got.psum_rank, lay.inclusive_psum(want.counts)) or got.num_recv != n:
        return None, [f"rows per source: psum {got.psum_rank.tolist()} ({got.num_recv} rows), "
                      f"expected {lay.inclusive_psum(want.counts).tolist()} ({n} rows)"]
    origin = got.meta[:n, 0].astype(np.int64)
    pos = np.minimum(np.searchsorted(want.origin, origin), max(n - 1, 0))
    if n and (not np.array_equal(want.origin[pos], origin) or len(np.unique(pos)) != n):
        return None, ["received (token, rank) pairs differ from the routing (missing or duplicated)"]
    problems = []
    if not np.array_equal(origin // max_tokens, np.repeat(np.arange(len(want.counts)), want.counts)):
        problems.append("rows are not grouped by source rank")
    if deterministic and not np.array_equal(pos, np.arange(n)):
        problems.append("deterministic rows are not in (source rank, source token) order")
    if not (got.meta[n:] == -1).all():
        problems.append("unused metadata rows are not -1")
    return pos, problems


def check_shapes(sources: Sources, opts: DispatchOptions, got: HostDispatch, rows: int) -> List[str]:
    """Output shapes: ``recv_x [rows, H]``, ids and weights ``[rows, K]`` (compact) or ``[rows]`` (expand),
    weights only when dispatched, metadata ``[N, 2+K]`` (worst case ``R * max_tokens`` rows without cpu_sync)."""
    k, hidden = sources.topk_idx[0].shape[1], sources.x[0].shape[1]
    ids = (rows,) if opts.expand else (rows, k)
    meta_rows = got.num_recv if opts.cpu_sync else lay.worst_case_recv_rows(sources.num_ranks, sources.max_tokens)
    problems = []
    if got.recv_x.shape != (rows, hidden):
        problems.append(f"recv_x has shape {got.recv_x.shape}, expected {(rows, hidden)}")
    if got.recv_idx.shape != ids:
        problems.append(f"recv_topk_idx has shape {got.recv_idx.shape}, expected {ids}")
    if (got.recv_w is not None) != opts.weighted:
        problems.append(f"recv_topk_weights is {'given' if got.recv_w is not None else 'None'}, "
                        f"weights {'were' if opts.weighted else 'were not'} dispatched")
    elif got.recv_w is not None and got.recv_w.shape != ids:
        problems.append(f"recv_topk_weights has shape {got.recv_w.shape}, expected {ids}")
    if got.meta.shape != (meta_rows, 2 + k):
        problems.append(f"recv_src_metadata has shape {got.meta.shape}, expected {(meta_rows, 2 + k)}")
    return problems


def check_compact(opts: DispatchOptions, want: Expected, got: HostDispatch) -> List[str]:
    """Compact outputs of the rows in received order (``want`` reordered; shapes checked): payload, local ids,
    weights."""
    n = got.num_recv
    problems = []
    if not same_bytes(got.recv_x[:n], want.x):
        problems.append("recv_x payload differs from the source rows")
    if not np.array_equal(got.recv_idx[:n], want.local) or not (got.recv_idx[n:] == -1).all():
        problems.append("recv_topk_idx differs from the local expert ids (or unused rows are not -1)")
    on_me = want.local >= 0
    if opts.weighted and not np.array_equal(got.recv_w[:n][on_me], want.weights[on_me]):
        problems.append("recv_topk_weights differ from the source weights")
    if not (got.meta[:n, 2:] == -1).all():
        problems.append("compact metadata columns 2.. are not -1")
    return problems


def check_expand(opts: DispatchOptions, want: Expected, got: HostDispatch, num_local: int) -> List[str]:
    """Expand outputs (``want`` reordered; shapes checked): each (token, local expert) pair once, in its expert's
    aligned block, byte-exact."""
    align = opts.alignment
    counts = want.expert_counts(num_local)
    psum = lay.expert_psum(counts, align, True)
    rows = int(lay.align_up(counts, align).sum())
    if not (np.array_equal(got.unaligned, counts) and np.array_equal(got.aligned, lay.align_up(counts, align))
            and np.array_equal(got.psum_expert, psum) and got.num_expanded == rows):
        return [f"per-expert counts {got.unaligned.tolist()} / psum {got.psum_expert.tolist()} / "
                f"{got.num_expanded} rows, expected {counts.tolist()} / {psum.tolist()} / {rows}"]
    n, problems = got.num_recv, []
    erow = got.meta[:n, 2:].astype(np.int64)
    if not np.array_equal(erow >= 0, want.local >= 0):
        return problems + ["expanded rows (metadata columns 2..) do not match the entries on this rank"]
    r, k = np.nonzero(want.local >= 0)
    expert, dest = want.local[r, k], erow[r, k]
    start = lay.expert_starts(psum, align)[expert]
    if not ((dest >= start) & (dest < start + counts[expert])).all() or len(np.unique(dest)) != len(dest):
        return problems + ["expanded rows outside their expert's block, or shared"]
    if not same_bytes(got.recv_x[dest], want.x[r]) or not np.array_equal(got.recv_idx[dest], expert):
        problems.append("expanded rows differ from their source rows / experts")
    if opts.weighted and not np.array_equal(got.recv_w[dest], want.weights[r, k]):
        problems.append("expanded weights differ from the source weights")
    if opts.deterministic and not np.array_equal(erow, lay.receive_layout(want.local, num_local, align,
                                                                          True).expanded_row):
        problems.append("deterministic expanded rows are not in (source rank, source token) order")
    pad = np.ones(len(got.recv_x), dtype=bool)
    pad[dest] = False
    if not (got.recv_idx[pad] == -1).all():
        problems.append("padding / unused rows of recv_topk_idx are not -1")
    if opts.zero_padding and np.ascontiguousarray(got.recv_x[:rows][pad[:rows]]).view(np.uint8).any():
        problems.append("padding rows are not zero")
    return problems


def check_dispatch(sources: Sources, me: int, opts: DispatchOptions, got: HostDispatch) -> List[str]:
    """Every check of one dispatch's outputs on rank ``me``; returns the problems found."""
    want = expected_receive(sources, me)
    pos, problems = match_rows(want, got, sources.max_tokens, opts.deterministic)
    if pos is None:
        return problems
    shape_problems = check_shapes(sources, opts, got, output_rows(sources, opts, want))
    if shape_problems:  # the content checks index by the expected shapes
        return problems + shape_problems
    want = want.reorder(pos)
    if opts.expand:
        return problems + check_expand(opts, want, got, sources.num_local)
    return problems + check_compact(opts, want, got)


def output_rows(sources: Sources, opts: DispatchOptions, want: Expected) -> int:
    """Rows of ``recv_x``: the received (compact) or expanded rows, or their worst case without cpu_sync."""
    if opts.expand:
        if opts.cpu_sync:
            return int(lay.align_up(want.expert_counts(sources.num_local), opts.alignment).sum())
        return lay.worst_case_expanded_rows(sources.num_ranks, sources.max_tokens, sources.topk_idx[0].shape[1],
                                            sources.num_local, opts.alignment)
    return len(want.origin) if opts.cpu_sync else lay.worst_case_recv_rows(sources.num_ranks, sources.max_tokens)


def check_combine(sources: Sources, me: int, opts: DispatchOptions, combined_x: Any, combined_w: Any,
                  bias_terms: Sequence[np.ndarray] = (), sent_back: Optional[SentBack] = None) -> List[str]:
    """The combine on rank ``me`` of its dispatch's rows (compact: ``sent_back(rank, rows)`` of them; expand:
    ``recv_x`` weighted when ``opts.weighted``) plus ``bias_terms``, bit for bit against
    :func:`expected_round_trip` (in the forwarded order with ``opts.forwarded_scaleup_ranks``); ``combined_w`` (the combine's ``topk_weights``) must be the dispatched
    weights where an entry has an expert, else 0, when weights were given, else None."""
    idx = np.asarray(sources.topk_idx[me])
    weights = sources.weights_of(me) if opts.weighted else None
    nodes = opts.forwarded_scaleup_ranks
    want = expected_round_trip(sources.x[me], idx, sources.num_experts, sources.num_ranks, opts.expand,
                               weights=weights, bias_terms=bias_terms, sent_back=sent_back,
                               forwarded=None if nodes is None else Forwarded(me, nodes))
    problem = first_mismatch(to_host(combined_x), want)
    problems = [] if problem is None else [f"combine differs: {problem}"]
    got_w = to_host(combined_w)
    if weights is None and got_w is not None:
        problems.append("combine returned topk_weights, but none were given")
    elif weights is not None and (got_w is None or not np.array_equal(got_w, np.where(idx >= 0, weights, 0))):
        problems.append("combine's topk_weights differ from the dispatched weights")
    return problems


def check_round_trip(sources: Sources, me: int, opts: DispatchOptions, out: Any, res: Any,
                     bias_terms: Sequence[np.ndarray] = (), sent_back: Optional[SentBack] = None) -> List[str]:
    """:func:`check_dispatch` of ``out`` (a ``DispatchOutput``) and :func:`check_combine` of ``res`` (its
    ``CombineOutput``) on rank ``me``; returns the problems found."""
    return (check_dispatch(sources, me, opts, HostDispatch.of(out))
            + check_combine(sources, me, opts, res.x, res.topk_weights, bias_terms, sent_back))


def check_counts(comm: MPI.Comm, sent_per_rank: np.ndarray, got: np.ndarray, out: Any, expand: bool) -> List[str]:
    """Collective over ``comm``: rows received from each source (``got [R]``) must equal what that source
    counted for this rank (``sent_per_rank [R]`` is what this rank counted for each), and ``recv_x`` must have
    the handle's number of rows (compact or expanded)."""
    want = np.asarray(comm.alltoall([int(c) for c in sent_per_rank]))
    failures = []
    if not np.array_equal(got, want):
        failures.append(f"rows per source rank {got.tolist()}, sources sent {want.tolist()}")
    if int(out.handle.num_recv_tokens) != int(want.sum()):
        failures.append(f"num_recv_tokens={int(out.handle.num_recv_tokens)}, sources sent {int(want.sum())}")
    rows = int(out.handle.num_expanded_tokens if expand else out.handle.num_recv_tokens)
    if len(out.recv_x) != rows:
        failures.append(f"recv_x has {len(out.recv_x)} rows, the handle says {rows}")
    return failures
