"""``Buffer.wait_stats()`` (docs/design.md, "Wait statistics"): every dispatch and combine adds, per peer, how long
this rank waited for that peer's signal. A rank made late by a known host delay before each of its calls is the
one its peers name: it came last in (all but at most one of) their waits, in eager calls, split calls (hooks) and
forwarded steps; the counts are exact (one measured wait per peer per dispatch or combine, none for this rank
itself or for the close); a reset zeroes them and ``Buffer(wait_stats=False)`` measures nothing.

Collective like the rest of ``tests/mpi`` (``tests/jobs/test_multirank.py`` runs it under ``mpirun -n 1..4``). Only
counts and names are asserted, no times (tests/README.md): the delay is long enough to dwarf the scheduling noise
of a loaded machine.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from helpers.collective import dispatch, make_buffer
from helpers.oracle import COMM, RANK, WORLD, make_world

from ep_comm.transport.wait_stats import WAIT_WORDS, late_share

pytestmark = pytest.mark.mpi

LATE = WORLD - 1  # the rank made late
DELAY_S = 0.2  # its host sleep before each of its calls
ROUNDS = 3  # dispatch + combine rounds per case


@pytest.fixture(scope="module")
def world():
    return make_world("uniform", dtype="bfloat16")


def late_rounds(buf, world, hooked: bool) -> None:
    """``ROUNDS`` dispatches of ``world`` and combines of their rows; rank ``LATE`` sleeps ``DELAY_S`` before each
    call (before the send half of a split one)."""
    for _ in range(ROUNDS):
        COMM.Barrier()
        if RANK == LATE:
            time.sleep(DELAY_S)
        out = dispatch(buf, world, return_recv_hook=hooked)
        out = out() if hooked else out
        if RANK == LATE:
            time.sleep(DELAY_S)
        res = buf.combine(out.recv_x, out.handle, return_recv_hook=hooked)
        if hooked:
            res()


def check_late_rank_named(stats) -> None:
    """This rank's ``stats`` after :func:`late_rounds`: exact counts, and (on a rank other than ``LATE``) ``LATE``
    named; every rank's tables merged name it too."""
    steps = 2 * ROUNDS
    assert stats.table.shape == (WORLD, WAIT_WORDS) and stats.enabled
    for p in stats.peers:
        assert p.steps == (0 if p.peer == RANK else steps), p
        assert sum(p.histogram) == p.steps
    assert stats.peers[RANK].times_last == 0 and stats.peers[RANK].total_us == 0
    if RANK != LATE:
        late = stats.peers[LATE]
        assert late.times_last >= steps - 1, stats.peers  # at most one wait lost to scheduling noise
        assert stats.slowest().peer == LATE, stats.peers
        assert late.max_us > 0 and late.p50_us > 0 and late.p50_us <= late.p99_us <= late.max_us
    shares = late_share(COMM.allgather(stats.table))
    if WORLD > 1:
        assert max(range(WORLD), key=shares.__getitem__) == LATE and shares[LATE] >= (steps - 1) / steps, shares


def test_a_late_rank_is_named_in_eager_calls(world):
    with make_buffer(world) as buf:
        assert buf.wait_stats().steps == 0
        late_rounds(buf, world, hooked=False)
        check_late_rank_named(buf.wait_stats())


def test_a_late_rank_is_named_by_the_hooks(world):
    with make_buffer(world) as buf:
        late_rounds(buf, world, hooked=True)
        check_late_rank_named(buf.wait_stats())


def test_a_late_rank_is_named_through_forwarders(world):
    """Every rank its own node (``scaleup_ranks=1``): every step goes through forwarders' inboxes, whose signals are
    the arrivals measured (a forwarder that waited for the late rank is not named for relaying after it)."""
    with make_buffer(world, scaleup_ranks=1, forwarding=True) as buf:
        late_rounds(buf, world, hooked=False)
        check_late_rank_named(buf.wait_stats())
        late_rounds(buf, world, hooked=True)
        stats = buf.wait_stats()
        assert all(p.steps == (0 if p.peer == RANK else 4 * ROUNDS) for p in stats.peers)


def test_a_reset_zeroes_them_and_the_off_switch_measures_nothing(world):
    with make_buffer(world) as buf:
        late_rounds(buf, world, hooked=False)
        before = buf.wait_stats(reset=True)
        assert before.steps == (2 * ROUNDS if WORLD > 1 else 0)
        assert not buf.wait_stats().table.any()
        dispatch(buf, world)
        assert buf.wait_stats().steps == (1 if WORLD > 1 else 0)
        buf.reset_wait_stats()
        assert not buf.wait_stats().table.any()
    with make_buffer(world, wait_stats=False) as off:
        late_rounds(off, world, hooked=False)
        stats = off.wait_stats()
        assert not stats.enabled and not np.asarray(stats.table).any() and stats.slowest() is None
