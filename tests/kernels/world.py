"""A simulated world of R ranks in one process: every rank's symmetric buffer is a plain array, the
scatter kernel gets all of them as its tuple of destinations, and each receiver runs its receive kernels
(``kernel_world`` draws one with random routings and payloads).

Expected values come from the NumPy reference (``ep_comm.contract.layout``, ``ep_comm.contract.reduce``) only; routings and
payloads from the shared generators of ``ep_comm.testing.routing``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host
from ep_comm.contract.checks import topk_values, verdict_words
from ep_comm.contract.symmetric import SymmetricLayout, symmetric_views, word_dtype
from ep_comm.launching import kernel_launches as kl
from ep_comm.testing import routing as gen
from ep_comm.testing.dtypes import DTYPES

NEGATIVE_ZERO_RATE = 0.05  # share of -0.0 payload entries
MAX_TOKENS = 24  # num_max_tokens_per_rank of a kernel_world unless given


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of a payload array, for bit-exact comparisons (NaN and -0.0 included)."""
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def random_routing(rng: np.random.Generator, tokens: int, topk: int, experts: int, *, masked: float = 0.1,
                   hot_expert: Optional[int] = None, nowhere: int = 0) -> np.ndarray:
    """``[T, K]`` int64 distinct experts per token (uniform, or ``hot_expert`` in every token's column 0),
    each entry -1 with probability ``masked``, the first ``nowhere`` tokens picking nothing."""
    kind = "uniform" if hot_expert is None else "hot"
    idx = gen.make_routing(kind, tokens, experts, topk, seed=rng, hot_expert=hot_expert or 0).topk_idx
    return gen.mask_routing(idx, rng, entry_rate=masked, first_tokens=nowhere)


def random_payload(rng: np.random.Generator, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """Normal values with a few -0.0, in ``dtype``."""
    return gen.random_payload(rng, shape, dtype, NEGATIVE_ZERO_RATE)


def routing_verdict(topk_idx: np.ndarray) -> tuple:
    """The two verdict words of a routing ``[T, K]`` by the host rule (``ep_comm.contract.checks``): what its count
    kernel sends."""
    return verdict_words(*topk_values(np, topk_idx)) if len(topk_idx) else verdict_words(-1, -1)


def with_verdict(words: np.ndarray, verdict: tuple = (0, 0)) -> np.ndarray:
    """The count words a sender's count kernel writes: ``words [R, 1 + L]`` (``ep_comm.contract.layout.send_count_words``)
    with the two encoded ``verdict`` words appended to every row (default: clean)."""
    return np.concatenate([words, np.tile(np.asarray(verdict, words.dtype), (len(words), 1))], axis=1)


def spy_launches(monkeypatch, arguments: Optional[list] = None) -> list:
    """The kernels every ``Kernels`` launches from now on (within the test), in launch order; with
    ``arguments``, each launch's ``(kernel, args)`` is appended to it as well."""
    launched = []
    launch = kl.Kernels._launch

    def spy(self, kernel, *args, **kwargs):
        launched.append(kernel)
        launcher = launch(self, kernel, *args, **kwargs)
        if arguments is None:
            return launcher

        def recorded(*kernel_args):
            arguments.append((kernel, kernel_args))
            return launcher(*kernel_args)
        return recorded

    monkeypatch.setattr(kl.Kernels, "_launch", spy)
    return launched


@dataclass
class Sent:
    slot_idx: np.ndarray  # [T, K] int32 as the kernel wrote it
    layout: object  # SendLayout (device arrays)


@dataclass
class Received:
    counts: object  # ReceiveCounts
    recv_x: np.ndarray
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray
    recv_src_metadata: np.ndarray


@dataclass
class World:
    """R simulated ranks with routings ``topk[s]``, payloads ``x[s]`` and weights ``w[s]`` (or None). ``sources[s]``,
    when given, is what source ``s``'s scatter reads instead of ``x[s]`` (an ``Fp8Rows`` whose packed rows are
    ``x[s]``)."""

    xp: object
    num_experts: int
    max_tokens: int
    topk: list
    x: list
    w: list
    kernels: kl.Kernels = field(init=False)
    sources: Optional[list] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.num_ranks = len(self.topk)
        self.num_topk = self.topk[0].shape[1]
        self.hidden = self.x[0].shape[1]
        self.dtype = self.x[0].dtype
        self.local = self.num_experts // self.num_ranks
        self.kernels = kl.Kernels(self.xp, num_ranks=self.num_ranks, num_experts=self.num_experts,
                               num_topk=self.num_topk, max_tokens=self.max_tokens, num_blocks=3, warps_per_block=2,
                               count_tokens_per_warp=16, recv_rows_per_unit=4,  # several groups and units
                               count_min_warps=0)  # count groups of several units (test_dispatch: the decode cut)
        self.sym = SymmetricLayout(self.num_ranks, self.max_tokens, self.hidden, self.num_topk, self.dtype.itemsize,
                                   self.local)
        self.buffers = [self.xp.zeros(self.sym.total_bytes, np.uint8) for _ in range(self.num_ranks)]
        self.views = [symmetric_views(b, self.sym, word_dtype(self.hidden, self.dtype.itemsize)) for b in self.buffers]

    def dev(self, a):
        return None if a is None else self.xp.asarray(a)

    def step(self, parity: int):
        """A device step counter whose parity is ``parity`` (a step number past the first two, as after a
        few operations)."""
        return self.xp.asarray(np.array([4 + parity], np.int64))

    def device_payload(self, a: np.ndarray):
        """Payloads go to the device as raw bits when the array module has no bfloat16."""
        if self.xp is np:
            return a
        return self.xp.asarray(a.view(np.uint16) if a.dtype == DTYPES["bfloat16"] else a)

    # ---- dispatch -------------------------------------------------------------------------------
    def send(self, parity: int, deterministic: bool, cached: Optional[list] = None,
             direct: Optional[list] = None) -> list:
        """Count and scatter on every source rank; the count exchange done by hand (the reference's words,
        ``ep_comm.contract.layout.send_count_words``). ``direct[s]``: with
        ``cached``, ``(recv_x, rank_psum)`` of receiver ``s``, where source ``s``'s rows to itself go."""
        k = self.kernels
        sent = []
        for s in range(self.num_ranks):
            topk = self.dev(self.topk[s])
            if cached is None:  # stable slots where they cost no more than atomic ones, as the backend counts
                stable = k.send_stable(topk.shape[0], deterministic)
                lay = k.count(topk, stable=stable, stream=0)
                slot_idx, mode = lay.slot_idx, kl.SLOT_STABLE if stable else kl.SLOT_ATOMIC
            else:
                lay, slot_idx, mode = None, self.dev(cached[s]), kl.SLOT_CACHED
            recv_x, recv_psum = direct[s] if direct is not None else (None, None)
            payload = self.device_payload(self.x[s]) if self.sources is None else self.sources[s]
            k.scatter(payload, topk, self.dev(self.w[s]), slot_idx,
                      [v.rows for v in self.views], [v.meta for v in self.views], src_rank=s, step=self.step(parity),
                      mode=mode, recv_x=recv_x, recv_psum=recv_psum, stream=0)
            sent.append(Sent(to_host(slot_idx), lay))
        for s in range(self.num_ranks):
            self.exchange_counts(parity, s, ref.send_count_words(
                ref.dispatch_layout(self.topk[s], self.num_experts, self.num_ranks)), routing_verdict(self.topk[s]))
        return sent

    def exchange_counts(self, parity: int, src: int, words: np.ndarray, verdict: tuple = (0, 0)) -> None:
        """The count exchange of source ``src``: row ``d`` of its ``words [R, 1 + L]`` and its ``verdict`` words
        (encoded, :func:`ep_comm.contract.checks.verdict_words`; default clean) into receiver ``d``'s count words of
        ``parity``."""
        block = with_verdict(words, verdict)
        for d in range(self.num_ranks):
            self.views[d].counts[parity, src] = self.xp.asarray(block[d])

    def outputs(self, *, expand: bool, alignment: int, worst_case: bool, num_rows: int, num_expanded: int,
                cached: Optional[Received] = None) -> tuple:
        """``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata)`` on the device, filled with values
        no kernel writes; worst-case sized when ``worst_case`` (cpu_sync=False); with ``cached`` the
        metadata holds the replayed handle's."""
        xp = self.xp
        if worst_case:
            num_rows = ref.worst_case_recv_rows(self.num_ranks, self.max_tokens)
            num_expanded = ref.worst_case_expanded_rows(self.num_ranks, self.max_tokens, self.num_topk, self.local,
                                                        alignment)
        out_rows = num_expanded if expand else num_rows
        ids_shape = (out_rows,) if expand else (out_rows, self.num_topk)
        recv_x = self.device_payload(np.full((out_rows, self.hidden), 3, dtype=self.dtype))  # 3.0: not zero
        topk_idx = xp.full(ids_shape, 77, dtype=np.int64)
        weights = xp.full(ids_shape, 5.0, dtype=np.float32)
        metadata = xp.full((num_rows, 2 + self.num_topk), 99, dtype=np.int32)
        if cached is not None:
            metadata[: cached.recv_src_metadata.shape[0]] = xp.asarray(cached.recv_src_metadata)
        return recv_x, topk_idx, weights, metadata

    def receive(self, d: int, parity: int, *, expand: bool, alignment: int, zero_padding: bool,
                deterministic: bool, worst_case: bool = False, cached: Optional[Received] = None,
                outputs: Optional[tuple] = None, skip_source: int = -1) -> Received:
        """Receiver ``d``'s receive kernels; outputs at worst-case size when ``worst_case`` (cpu_sync=False),
        or ``outputs`` (from :meth:`outputs`, given to the scatter with ``skip_source=d``)."""
        k, view = self.kernels, self.views[d]
        if cached is None:
            counts = k.receive_count(view.counts, view.meta, self.step(parity), alignment=alignment, expand=expand,
                                     stable=deterministic, stream=0)
            mode = kl.PLACE_STABLE if deterministic else kl.PLACE_ATOMIC
            num_rows, num_expanded = (int(v) for v in to_host(counts.totals))
        else:
            counts, mode = cached.counts, kl.PLACE_CACHED
            num_rows = cached.recv_src_metadata.shape[0]
            num_expanded = cached.recv_x.shape[0]
        if outputs is None:
            outputs = self.outputs(expand=expand, alignment=alignment, worst_case=worst_case, num_rows=num_rows,
                                   num_expanded=num_expanded, cached=cached)
        recv_x, topk_idx, weights, metadata = outputs
        k.receive_copy(counts.rank_psum, view.rows, view.meta, self.step(parity), recv_x, topk_idx, weights, metadata,
                       expand=expand, mode=mode, expert_psum=counts.expert_psum, alignment=alignment,
                       zero_padding=zero_padding, skip_source=skip_source, stream=0)
        host_x = to_host(recv_x)
        if host_x.dtype == np.uint16:
            host_x = host_x.view(self.dtype)
        return Received(counts, host_x, to_host(topk_idx), to_host(weights), to_host(metadata))

    # ---- expectations ----------------------------------------------------------------------------
    def arrivals(self, d: int, sent: list) -> list:
        """``(src, token, slot)`` of every row rank ``d`` receives, in compact order (slot order per source)."""
        rows = []
        for s in range(self.num_ranks):
            ranks = ref.entry_ranks(self.topk[s], self.local)
            tok, col = np.nonzero((ranks == d) & (sent[s].slot_idx >= 0))
            slots = sent[s].slot_idx[tok, col] - s * self.max_tokens
            rows += [(s, int(t), int(sl)) for sl, t in sorted(zip(slots, tok))]
        return rows

    def expected_compact(self, d: int, sent: list) -> dict:
        """Reference compact outputs of receiver ``d`` given the slots the senders used."""
        rows = self.arrivals(d, sent)
        k = self.num_topk
        local = np.array([ref.local_topk(self.topk[s][t:t + 1], d, self.local)[0] for s, t, _ in rows]).reshape(-1, k)
        weights = np.zeros(local.shape, np.float32)
        for i, (s, t, _) in enumerate(rows):
            if self.w[s] is not None:
                weights[i] = np.where(local[i] >= 0, self.w[s][t], 0)
        x = np.array([self.x[s][t] for s, t, _ in rows], dtype=self.dtype).reshape(-1, self.hidden)
        origin = np.array([[s * self.max_tokens + t, s * self.max_tokens + sl] for s, t, sl in rows],
                          dtype=np.int32).reshape(-1, 2)
        return {"x": x, "local": local, "weights": weights, "origin": origin,
                "per_source": np.bincount([s for s, _, _ in rows], minlength=self.num_ranks)}


def kernel_world(xp, *, seed=0, ranks=3, experts=12, topk=3, hidden=20, tokens=(10, 13, 0), dtype="bfloat16",
                 weights=True, max_tokens=MAX_TOKENS, **routing) -> World:
    """A ``World`` of ``ranks`` simulated ranks over ``xp`` with ``tokens[r]`` random tokens on rank ``r``: routings of
    ``random_routing`` (``routing``: its ``masked``, ``hot_expert``, ``nowhere``), payloads of ``random_payload`` in
    ``dtype``, float32 weights unless ``weights`` is False; all drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    routings = [random_routing(rng, t, topk, experts, **routing) for t in tokens[:ranks]]
    xs = [random_payload(rng, (t, hidden), DTYPES[dtype]) for t in tokens[:ranks]]
    ws = [rng.random((t, topk)).astype(np.float32) if weights else None for t in tokens[:ranks]]
    return World(xp, experts, max_tokens, routings, xs, ws)
