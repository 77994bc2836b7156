"""A multi-rank fake GPU: ``R`` nvshmem backends in one process, one thread per rank, every rank's symmetric heap a
host array the others reach as their peer view, the kernels in the Numba CUDA simulator, and the signal and wait
kernels (the step's and the forwarding inbox's) stood in for on the host, as ``fake_gpu.LoopbackTransport`` does for
one rank. The waits that ``inbox_signals.measured_wait`` says the GPU measures add to wait statistics kept as the
wait kernel keeps them (``wait_stats.HostWaits``, wall-clock delays from the wait's entry to each peer's signal).

The ranks take turns: a rank's thread holds the world's lock for its whole call (its launches run under it, one
kernel at a time in the simulator) and lets go of it only in a wait, until every rank's signal came (or the wait's
bound passed: the ranks that did not come are missing, as the wait kernel flags them). So the real call sequence
runs with its ranks interleaved the way a GPU's streams would let them: a rank's send half runs before its peers'
waits see its signal, and nothing spins.

:func:`run_ranks` runs one callable per rank on its backend (:func:`world_backends`) and returns their results or
raises the first rank's error."""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ep_comm.backends.interface import BackendSettings
from ep_comm.backends.nvshmem import NvshmemBackend
from ep_comm.backends.nvshmem.backend import puts_peers
from ep_comm.contract.forward_inbox import ForwardInbox, inbox_views
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import ABORT_WORDS, SymmetricLayout, symmetric_views, word_dtype
from ep_comm.contract.topology import Topology, transport_mode
from ep_comm.testing.check import Sources
from ep_comm.testing.routing import mask_routing, uniform_routing
from ep_comm.transport.forward_views import forward_views
from ep_comm.transport.inbox_signals import measured_wait
from ep_comm.transport.wait_stats import HostWaits
from helpers.fake_gpu import HostDevice, RootCheckingCalls

WAIT_BOUND_S = 20.0  # a fake wait's bound, in wall time (the simulator is slow): a rank missing past it is named


class World:
    """Every rank's heap (uint8, the symmetric buffer and, forwarding across several nodes, the inbox after it), the
    lock the ranks take turns under and the condition their waits wait on (``turn``), and the backends' settings
    (deterministic, waits bounded by ``timeout_s``, at most :data:`WAIT_BOUND_S`; ``transport``: ``"auto"``, the
    ranks of other nodes through puts, which a flat step across nodes cannot fake, or ``"stores"``, every rank
    through stores, so that a flat step runs across nodes)."""

    def __init__(self, geo: Geometry, scaleup_ranks: Optional[int], forwarding: bool,
                 timeout_s: float = WAIT_BOUND_S, transport: str = "auto"):
        self.geo, self.num_ranks = geo, geo.num_ranks
        self.sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize,
                                   geo.experts_per_rank)
        self.word = word_dtype(geo.hidden, geo.dtype.itemsize)
        self.topology = Topology.of(geo.num_ranks, scaleup_ranks)
        self.settings = BackendSettings(True, timeout_s, transport=transport, scaleup_ranks=scaleup_ranks,
                                        forwarding=forwarding)
        across = forwarding and self.topology.num_nodes > 1
        self.inbox = ForwardInbox(self.sym, self.topology.scaleup_ranks) if across else None
        nbytes = self.sym.total_bytes if self.inbox is None else self.inbox.total_bytes
        self.heaps = [np.zeros(nbytes, np.uint8) for _ in range(self.num_ranks)]
        self.views = [symmetric_views(h[: self.sym.total_bytes], self.sym, self.word) for h in self.heaps]
        self.turn = threading.Condition()

    def inbox_signals(self, rank: int) -> np.ndarray:
        """int64 ``[R]``: rank ``rank``'s inbox signal words."""
        assert self.inbox is not None
        return inbox_views(self.heaps[rank], self.inbox, self.word).signal


def arrived(words: np.ndarray, seq: int, kind: int) -> List[bool]:
    """Per rank, whether its signal word in ``words`` (int64 ``[R]``) says it reached step ``seq`` of ``kind`` (or
    the next step), as the wait kernel reads it."""
    return [int(w) == seq << 2 | kind or int(w) >= (seq + 1) << 2 for w in words.tolist()]


class WorldTransport:
    """``NvshmemTransport`` of rank ``rank`` of ``world``: the peers' heaps through stores, the ranks of other nodes
    (``transport="auto"``) through puts, whose staging views are host arrays nothing sends (a forwarded step's
    scatter writes its rows for other nodes there, unsent; a flat step across nodes is not faked: :meth:`flush`
    raises); with an inbox, the forwarded step's views and the inbox signal and wait."""

    device = None  # no GPU: arrays are not checked for theirs

    def __init__(self, world: World, rank: int):
        self.world, self.rank, self.sym = world, rank, world.sym
        self.puts_to = puts_peers(world.settings, world.num_ranks, rank)
        self.mode = transport_mode(self.puts_to, world.num_ranks, rank)
        self.own = world.views[rank]
        shape = self.own.rows.shape
        self.rows = tuple(np.zeros(shape, self.own.rows.dtype) if q in self.puts_to else v.rows
                          for q, v in enumerate(world.views))
        self.meta = tuple(np.zeros(self.own.meta.shape, np.int32) if q in self.puts_to else v.meta
                          for q, v in enumerate(world.views))
        self.step = np.zeros(1, np.int64)
        self.missing: List[int] = []
        self.aborts = np.zeros((world.num_ranks, ABORT_WORDS), np.int64)
        self.forward = None if world.inbox is None else forward_views(world.heaps, world.inbox, rank, world.word, np,
                                                                      lambda a: a)
        self.inbox_signals_sent = 0  # inbox signals sent (each to every rank)
        self.closed_collectively: Optional[bool] = None
        self.measuring = True  # the backend sets it from Buffer(wait_stats=...)
        self.waits = HostWaits(world.num_ranks, rank)

    def flush(self, stream: Any, psum: Callable[[], Any], with_meta: bool, timed: Any = None) -> None:
        """Nothing without puts; the fake sends no staged rows."""
        if self.puts_to:
            raise AssertionError(f"rank {self.rank}: the fake world puts nothing, but a step flushes rows staged for "
                                 f"ranks {list(self.puts_to)}")

    def exchange(self, stream: Any, kind: int, timeout_s: float, counts: Any = None) -> None:
        self.signal(stream, kind, counts)
        self.wait(kind, timeout_s, counts is not None)

    def signal(self, stream: Any, kind: int, counts: Any = None) -> None:
        """The step's signal: the step counter advanced, ``counts`` row ``q`` into rank ``q``'s count words of this
        step's parity, then ``signal[me]`` in every rank."""
        self.step[0] += 1
        seq = int(self.step[0])
        for q, view in enumerate(self.world.views):
            if counts is not None:
                view.counts[seq % 2, self.rank] = counts[q]
            view.signal[self.rank] = seq << 2 | kind
        self.world.turn.notify_all()

    def wait(self, kind: int, timeout_s: float, with_counts: bool) -> None:
        """The bounded wait for every rank's signal of the step the counter holds; the ranks that did not come are
        missing (their count words zeroed with ``with_counts``)."""
        seq = int(self.step[0])
        missing = self._wait_for(lambda: arrived(self.own.signal, seq, kind), timeout_s,
                                 self._measured(kind, inbox=False))
        if with_counts:
            for q in missing:
                self.own.counts[seq % 2, q] = 0

    def inbox_signal(self, kind: int) -> None:
        """``inbox.signal[me] = (step + 1) << 2 | kind`` in every rank; the step counter is not advanced."""
        word = (int(self.step[0]) + 1) << 2 | kind
        for q in range(self.world.num_ranks):
            self.world.inbox_signals(q)[self.rank] = word
        self.inbox_signals_sent += 1
        self.world.turn.notify_all()

    def inbox_wait(self, kind: int, timeout_s: float) -> None:
        """The bounded wait for every rank's inbox signal of this step."""
        seq = int(self.step[0]) + 1
        self._wait_for(lambda: arrived(self.world.inbox_signals(self.rank), seq, kind), timeout_s,
                       self._measured(kind, inbox=True))

    def _measured(self, kind: int, inbox: bool) -> bool:
        """``NvshmemTransport._measured``: whether this wait adds to the wait statistics."""
        return measured_wait(self.measuring, kind, self.forward is not None, inbox)

    def _wait_for(self, came: Callable[[], List[bool]], timeout_s: float, measured: bool) -> List[int]:
        """Let the other ranks run until ``came()`` says every rank came, or ``min(timeout_s, WAIT_BOUND_S)`` passed;
        the ranks that did not come are added to :attr:`missing` (sticky) and returned. ``measured``: each arrival is
        seen when this rank next gets the lock, and the wait's delays go into :attr:`waits`. A wait that starts with
        ranks missing (an earlier wait of the step found them so) waits for no one, as the wait kernel does: every rank
        is returned (their count words zeroed) and none is added."""
        if self.missing:
            return list(range(self.world.num_ranks))
        clock = self.waits.clock(lambda: np.array(came())) if measured else None

        def every_rank_came() -> bool:
            if clock is not None:
                clock.poll()
            return all(came())

        self.world.turn.wait_for(every_rank_came, timeout=min(timeout_s, WAIT_BOUND_S))
        if clock is not None:
            clock.finish()
        missing = [q for q, ok in enumerate(came()) if not ok]
        self.missing = sorted(set(self.missing) | set(missing))
        return missing

    def wait_state(self) -> tuple:
        return self.missing, any(self.aborts[:, 0].tolist())

    def wait_table(self) -> np.ndarray:
        return self.waits.table

    def reset_waits(self) -> None:
        self.waits.reset()

    def post_abort(self, record: Any) -> None:
        """Nobody is told (each rank finds out at its own wait's bound)."""

    def abort_table(self) -> np.ndarray:
        return self.aborts

    def close(self, collective: bool) -> None:
        self.closed_collectively = collective


class FakeComm:
    """The communicator a backend keeps: its rank and size; freeing it does nothing."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Free(self) -> None:  # noqa: N802 (mpi4py's name)
        """Nothing to free."""


def world_backends(world: World) -> List[NvshmemBackend]:
    """One ``NvshmemBackend`` per rank of ``world`` (deterministic, kernels in the simulator, 2 blocks of 2 warps),
    its recorded calls in check mode (``fake_gpu.RootCheckingCalls``)."""
    backends = []
    for rank in range(world.num_ranks):
        be = NvshmemBackend(FakeComm(rank, world.num_ranks), world.geo, world.settings,
                            transport=WorldTransport(world, rank), device=HostDevice(), num_sms=1,
                            launch=dict(num_blocks=2, warps_per_block=2))
        be.runner.recorded = RootCheckingCalls()
        backends.append(be)
    return backends


def run_ranks(world: World, calls: List[Callable[[], Any]], timeout_s: float = 600.0) -> List[Any]:
    """``calls[r]()`` on a thread of its own per rank, each holding ``world.turn`` but in its waits; returns their
    results in rank order. A rank's error is raised (the first rank's that failed); a rank not done within
    ``timeout_s`` raises RuntimeError naming it."""
    results: List[Any] = [None] * len(calls)
    errors: List[Optional[BaseException]] = [None] * len(calls)

    def run(rank: int) -> None:
        with world.turn:
            try:
                results[rank] = calls[rank]()
            except BaseException as error:  # handed to the caller's thread
                errors[rank] = error
            finally:
                world.turn.notify_all()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}", daemon=True) for r in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        raise RuntimeError(f"ranks {stuck} of the fake world did not finish within {timeout_s} s")
    for error in errors:
        if error is not None:
            raise error
    return results


def random_sources(geo: Geometry, tokens: Sequence[int], weighted: bool, seed: int) -> Sources:
    """Every rank's inputs for ``geo``: ``tokens[r]`` tokens of uniform top-K routing with a fifth of the entries
    masked and the first token routed nowhere, normal payload in ``geo.dtype``, float32 weights when ``weighted``."""
    rng = np.random.default_rng(seed)
    idx = [mask_routing(uniform_routing(t, geo.num_experts, geo.num_topk, seed=rng).topk_idx, rng, entry_rate=0.2,
                        first_tokens=1) for t in tokens]
    xs = [rng.standard_normal((t, geo.hidden)).astype(geo.dtype) for t in tokens]
    ws = [rng.random((t, geo.num_topk)).astype(np.float32) if weighted else None for t in tokens]
    return Sources(geo.num_experts, geo.max_tokens, idx, xs, ws)
