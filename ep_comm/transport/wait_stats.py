"""Per-peer wait statistics: how long each wait of a dispatch or combine waited for each peer's signal.

Every measured wait adds, per peer ``s`` other than this rank that arrived, its *delay*: 0 when ``s``'s signal was
there at the wait's first poll, else the time from this rank's entry into the wait to the poll that saw it (at
least 1 ns). The table is int64 ``[R, WAIT_WORDS]``, one row per peer (this rank's own row stays 0), laid out as
``ep_comm.kernels.signal_wait`` says: steps, times last (the waits in which ``s``'s delay was the longest and not
0; ties all count), total, max and most recent delay in nanoseconds, then a histogram of ``WAIT_BUCKETS`` buckets
(0: delay 0; 1: below 1024 ns; then two per octave). On ``nvshmem`` the wait kernel keeps it in device memory
(``%globaltimer``, so CUDA-graph replays count and no step pays a host round trip); on ``mpi`` the host wait loop
keeps it in NumPy (:class:`HostWaits`, ``time.perf_counter_ns``). ``Buffer.wait_stats()`` decodes it
(:func:`decode`: :class:`WaitStats`); the bench and the soak merge the tables of every rank
(:func:`late_share`, :func:`wait_us_p50`, :func:`straggler_line`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ep_comm.kernels.signal_wait import (
    WAIT_BUCKETS,
    WAIT_HIST,
    WAIT_LAST,
    WAIT_MAX,
    WAIT_RECENT,
    WAIT_STEPS,
    WAIT_TOTAL,
    WAIT_WORDS,
)

__all__ = ["WAIT_WORDS", "HostWaits", "PeerWaits", "WaitStats", "bucket_bounds", "bucket_of", "decode",
           "empty_table", "late_share", "merge", "percentile_ns", "straggler_line", "wait_us_p50"]


def empty_table(num_ranks: int) -> np.ndarray:
    """A zero int64 ``[R, WAIT_WORDS]`` table."""
    return np.zeros((num_ranks, WAIT_WORDS), dtype=np.int64)


def bucket_of(delay_ns: np.ndarray) -> np.ndarray:
    """The histogram bucket of each delay (int64 ns, ``>= 0``), as the wait kernel's ``wait_bucket``."""
    d = np.asarray(delay_ns, dtype=np.int64)
    e = np.frexp(np.maximum(d, 1).astype(np.float64))[1].astype(np.int64) - 1  # floor(log2 d), exact below 2**53
    half = np.right_shift(d, np.maximum(e - 1, 0)) & 1
    b = np.minimum(2 * (e - 10) + 2 + half, WAIT_BUCKETS - 1)
    return np.where(d == 0, 0, np.where(e < 10, 1, b))


def bucket_bounds(bucket: int) -> Tuple[float, float]:
    """``[low, high)`` nanoseconds of histogram bucket ``bucket`` (the last one's high is infinite)."""
    if bucket == 0:
        return 0.0, 0.0
    if bucket == 1:
        return 1.0, 1024.0
    e, half = 10 + (bucket - 2) // 2, (bucket - 2) % 2
    low = 2.0 ** e * (1.0 + 0.5 * half)
    return low, (float("inf") if bucket == WAIT_BUCKETS - 1 else low + 2.0 ** (e - 1))


def percentile_ns(histogram: np.ndarray, q: float, max_ns: int) -> float:
    """The ``q``-quantile (0..1) of the delays counted in ``histogram`` (``[WAIT_BUCKETS]``): the middle of the
    bucket that holds it, at most ``max_ns`` (the largest delay seen); 0 for an empty histogram."""
    counts = np.asarray(histogram, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        return 0.0
    bucket = int(np.searchsorted(np.cumsum(counts), max(1, int(np.ceil(q * n)))))
    low, high = bucket_bounds(bucket)
    middle = low if high == float("inf") else (low + high) / 2
    return float(min(middle, max_ns))


class PeerWaits(NamedTuple):
    """One peer's waits as this rank saw them (``WaitStats.peers``); times in microseconds."""

    peer: int
    steps: int  # measured waits that saw this peer's signal arrive
    times_last: int  # of them, those in which it came last (its delay the longest and not 0)
    total_us: float  # the delays summed
    p50_us: float  # from the histogram: the middle of the bucket holding the median (<= max_us)
    p99_us: float
    max_us: float
    recent_us: float  # the delay of the last measured wait
    histogram: Tuple[int, ...]  # WAIT_BUCKETS counts (bucket_bounds gives each one's range)


@dataclass(frozen=True)
class WaitStats:
    """What ``Buffer.wait_stats()`` returns: this rank's waits for each peer since construction or the last reset.

    ``rank``: this rank; ``peers``: one :class:`PeerWaits` per rank (this rank's own is all zero); ``table``: the
    raw int64 ``[R, WAIT_WORDS]`` table (the bench and the soak merge the tables of every rank); ``enabled``: False
    for a Buffer made with ``wait_stats=False`` (nothing is measured, every count is 0).
    """

    rank: int
    peers: Tuple[PeerWaits, ...]
    table: np.ndarray
    enabled: bool = True

    @property
    def steps(self) -> int:
        """The measured waits (the most any peer was seen in)."""
        return max((p.steps for p in self.peers), default=0)

    def slowest(self) -> Optional[PeerWaits]:
        """The peer this rank waited for most (the largest total), or None when it never waited."""
        best = max(self.peers, key=lambda p: p.total_us, default=None)
        return best if best is not None and best.total_us > 0 else None


def decode(table: np.ndarray, rank: int, enabled: bool = True) -> WaitStats:
    """The :class:`WaitStats` of rank ``rank``'s int64 ``[R, WAIT_WORDS]`` table."""
    table = np.array(table, dtype=np.int64).reshape(-1, WAIT_WORDS)
    peers = []
    for s, row in enumerate(table):
        hist = row[WAIT_HIST:WAIT_HIST + WAIT_BUCKETS]
        peak = int(row[WAIT_MAX])
        peers.append(PeerWaits(s, int(row[WAIT_STEPS]), int(row[WAIT_LAST]), row[WAIT_TOTAL] / 1e3,
                               percentile_ns(hist, 0.5, peak) / 1e3, percentile_ns(hist, 0.99, peak) / 1e3,
                               peak / 1e3, row[WAIT_RECENT] / 1e3, tuple(int(c) for c in hist)))
    return WaitStats(rank, tuple(peers), table, enabled)


def merge(tables: Sequence[np.ndarray]) -> np.ndarray:
    """The table of several measuring periods of one rank, in order (counts and totals added, the maxima's
    maximum, the last period's recent delay)."""
    out = np.sum(np.stack(tables), axis=0)
    out[:, WAIT_MAX] = np.max(np.stack(tables)[:, :, WAIT_MAX], axis=0)
    out[:, WAIT_RECENT] = tables[-1][:, WAIT_RECENT]
    return out


def late_share(tables: Sequence[np.ndarray]) -> List[float]:
    """Per rank ``r``, over every other rank's table (``tables[o]``, rank ``o``'s): the fraction of their measured
    waits in which ``r`` came last (0 where nobody measured a wait for ``r``)."""
    stack = np.stack(tables)  # [observer, peer, word]; an observer's own row is zero
    steps, last = stack[:, :, WAIT_STEPS].sum(axis=0), stack[:, :, WAIT_LAST].sum(axis=0)
    return [float(last[r] / steps[r]) if steps[r] else 0.0 for r in range(stack.shape[1])]


def wait_us_p50(tables: Sequence[np.ndarray]) -> List[float]:
    """Per rank ``r``: the median of how long the other ranks waited for ``r`` (their histograms of ``r`` merged),
    microseconds."""
    stack = np.stack(tables)
    hist = stack[:, :, WAIT_HIST:WAIT_HIST + WAIT_BUCKETS].sum(axis=0)
    peak = stack[:, :, WAIT_MAX].max(axis=0)
    return [percentile_ns(hist[r], 0.5, int(peak[r])) / 1e3 for r in range(stack.shape[1])]


def summary(tables: Sequence[np.ndarray]) -> dict:
    """The JSON section of every rank's tables: ``late_share`` and ``wait_us_p50`` (lists over ranks), and
    ``wait_us_total`` (per rank, how long the others waited for it in all)."""
    stack = np.stack(tables)
    return {"late_share": late_share(tables), "wait_us_p50": wait_us_p50(tables),
            "wait_us_total": (stack[:, :, WAIT_TOTAL].sum(axis=0) / 1e3).tolist()}


def straggler_line(section: Optional[dict]) -> str:
    """One line naming the rank that made the others wait most (the largest ``wait_us_total``) of a
    :func:`summary` section, and by how much."""
    if not section or not section.get("wait_us_total") or max(section["wait_us_total"]) <= 0:
        return "waits: no rank made the others wait (or wait statistics are off)"
    totals = section["wait_us_total"]
    r = int(np.argmax(totals))
    return (f"waits: rank {r} made the others wait most: last in {100 * section['late_share'][r]:.0f}% of their "
            f"waits, p50 {section['wait_us_p50'][r]:.1f} us, {totals[r] / 1e3:.1f} ms in all")


def _bucket(delay: int) -> int:
    """:func:`bucket_of` of one delay, in Python integers (the host clock's)."""
    if delay == 0:
        return 0
    e = delay.bit_length() - 1
    if e < 10:
        return 1
    return min(2 * (e - 10) + 2 + ((delay >> (e - 1)) & 1), WAIT_BUCKETS - 1)


class HostWaits:
    """The wait statistics of one mpi Buffer on one rank, kept on the host in Python integers (a few microseconds
    per wait); :attr:`table` is their int64 ``[R, WAIT_WORDS]`` copy. ``enabled`` False: nothing is measured
    (:meth:`clock` returns None)."""

    def __init__(self, num_ranks: int, rank: int, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.rows = [[0] * WAIT_WORDS for _ in range(num_ranks)]

    @property
    def table(self) -> np.ndarray:
        """A copy of the statistics: int64 ``[R, WAIT_WORDS]``."""
        return np.array(self.rows, dtype=np.int64).reshape(len(self.rows), WAIT_WORDS)

    def clock(self, arrived: Callable[[], np.ndarray]) -> Optional["WaitClock"]:
        """A clock for one wait starting now, or None when disabled. ``arrived()``: bool ``[R]``, which ranks' signals
        show them arrived (called after each window sync of the wait loop: :meth:`WaitClock.poll`)."""
        return WaitClock(self, arrived) if self.enabled else None

    def reset(self) -> None:
        for row in self.rows:
            row[:] = [0] * WAIT_WORDS


class WaitClock:
    """One measured wait on the host: :meth:`poll` after every window sync of the wait loop (its first call is the
    first poll), :meth:`finish` once every peer arrived, which adds the delays to the table."""

    def __init__(self, waits: HostWaits, arrived: Callable[[], np.ndarray]):
        self.waits, self.arrived = waits, arrived
        self.pending = [s for s in range(len(waits.rows)) if s != waits.rank]  # peers not seen yet
        self.delays: List[Tuple[int, int]] = []  # (peer, delay ns) of the peers seen
        self.polls = 0
        self.start = time.perf_counter_ns()

    def poll(self) -> None:
        """Note the peers whose signal shows now, for the first time: delay 0 at the first poll, else the time since
        the wait's entry (at least 1 ns)."""
        if self.pending:
            seen = self.arrived()
            now = [s for s in self.pending if seen[s]]
            if now:
                delay = 0 if self.polls == 0 else max(1, time.perf_counter_ns() - self.start)
                self.delays += [(s, delay) for s in now]
                self.pending = [s for s in self.pending if not seen[s]]
        self.polls += 1

    def finish(self) -> None:
        """Add this wait's delays (every peer that arrived but this rank) to the table, as the wait kernel does. A
        last poll first: a signal that landed between the clock's read and the wait loop's own is seen now."""
        self.poll()
        rows = self.waits.rows
        longest = max((d for _, d in self.delays), default=0)
        for s, d in self.delays:
            row = rows[s]
            row[WAIT_STEPS] += 1
            row[WAIT_TOTAL] += d
            row[WAIT_MAX] = max(row[WAIT_MAX], d)
            row[WAIT_RECENT] = d
            row[WAIT_HIST + _bucket(d)] += 1
            if d and d == longest:
                row[WAIT_LAST] += 1
