"""The wait statistics' table (``ep_comm.transport.wait_stats``) on the host: the histogram buckets are the wait
kernel's (``wait_bucket`` in ``ep_comm.kernels.signal_wait``, mirrored here in plain integers), a host clock adds a
wait as the kernel does (delay 0 for a peer there at the first poll, the longest non-zero delay counted last, this
rank's own row untouched), and the merged figures of several ranks (late share, p50) read them back."""
from __future__ import annotations

import numpy as np

from ep_comm.kernels.signal_wait import WAIT_BUCKETS, WAIT_HIST, WAIT_LAST, WAIT_STEPS
from ep_comm.transport.wait_stats import (
    HostWaits,
    _bucket,
    bucket_bounds,
    bucket_of,
    decode,
    late_share,
    percentile_ns,
    straggler_line,
    summary,
    wait_us_p50,
)


def kernel_bucket(delay: int) -> int:
    """``wait_bucket`` of the CUDA C, line for line."""
    if delay == 0:
        return 0
    e = delay.bit_length() - 1
    if e < 10:
        return 1
    b = 2 * (e - 10) + 2 + ((delay >> (e - 1)) & 1)
    return min(b, WAIT_BUCKETS - 1)


def test_buckets_are_the_kernels_and_hold_their_delays():
    delays = [0, 1, 1023, 1024, 1535, 1536, 2047, 2048, 3_000_000, 2 ** 40, 2 ** 62] + \
        [int(v) for v in np.random.default_rng(0).integers(1, 2 ** 36, 2000)]
    got = bucket_of(np.array(delays, dtype=np.int64)).tolist()
    assert got == [kernel_bucket(d) for d in delays] == [_bucket(d) for d in delays]
    for d, b in zip(delays, got):
        low, high = bucket_bounds(b)
        assert (low <= d < high) if b else d == 0


def test_a_host_clock_adds_a_wait_as_the_kernel_does():
    waits = HostWaits(4, rank=1)
    seen = [np.array([True, True, False, False]), np.array([True, True, False, True]),
            np.array([True, True, True, True])]
    clock = waits.clock(lambda: seen.pop(0) if seen else np.ones(4, bool))
    for _ in range(3):
        clock.poll()
    clock.finish()
    table = waits.table
    assert table[1].sum() == 0 and table.shape == (4, 53)
    assert table[:, WAIT_STEPS].tolist() == [1, 0, 1, 1]
    assert table[:, WAIT_LAST].tolist() == [0, 0, 1, 0]  # rank 2 came at the last poll
    assert table[0, WAIT_HIST] == 1 and table[1].sum() == 0  # rank 0 was there at the first poll; rank 1 is me
    stats = decode(table, 1)
    assert stats.slowest().peer == 2 and stats.peers[2].times_last == 1 and stats.steps == 1
    assert HostWaits(4, rank=1, enabled=False).clock(lambda: np.ones(4, bool)) is None


def test_every_ranks_tables_merge_into_late_share_and_p50():
    tables = []
    for rank in range(3):  # rank 2 late by 3 ms in every one of 10 waits of the others
        table = HostWaits(3, rank).table
        table[:, WAIT_STEPS] = 10
        table[rank] = 0
        if rank != 2:
            table[2, WAIT_LAST] = 10
            table[2, WAIT_HIST + int(bucket_of(np.array([3_000_000]))[0])] = 10
            table[2, 3] = 3_000_000  # WAIT_MAX
            table[2, 2] = 30_000_000  # WAIT_TOTAL
            table[1 - rank, WAIT_HIST] = 10
        else:
            table[:2, WAIT_HIST] = 10
        tables.append(table)
    assert late_share(tables) == [0.0, 0.0, 1.0]
    p50 = wait_us_p50(tables)
    assert p50[:2] == [0.0, 0.0] and 2000 < p50[2] < 3000.001
    assert "rank 2 made the others wait most: last in 100%" in straggler_line(summary(tables))
    assert percentile_ns(np.zeros(WAIT_BUCKETS, np.int64), 0.5, 0) == 0.0
