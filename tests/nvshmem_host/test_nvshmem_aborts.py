"""Abort records and the step guard they feed, without a GPU: the wait status the GPU fills (missing ranks, posted
records), step words, records encoded and decoded, ``Steps`` (``backends.collective_steps``) reading them only when
it must and marking the buffer unusable, and the simulated nvshmem backend raising a peer's record (kernels in the
Numba CUDA simulator, a loopback transport on one rank)."""

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, simulated_backend

from ep_comm.backends.aborts import REASON_BYTES, decode, encode
from ep_comm.backends.collective_steps import STEP_KINDS, Steps, step_word
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import ABORT_WORDS
from ep_comm.errors import BufferUnusableError, PeerAbortedError
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.testing.routing import uniform_routing
from ep_comm.transport.signals import STATUS_FLAGS, read_status, status_state


def test_read_status_reports_sticky_missing_ranks_and_posted_abort_records():
    words = [13, 0, 0, 0, 0, 0, 0, 0]
    outcome = read_status(words, 3)
    assert outcome.missing_ranks == [] and outcome.last_seq == 13 and outcome.aborted_ranks == []
    words = [17, 2, 1, 0, 1, 0, 0, 1]
    assert read_status(words, 3).missing_ranks == [0, 2] and read_status(words, 3).aborted_ranks == [2]
    assert STATUS_FLAGS == 2


@pytest.mark.parametrize("words", [[13, 0, 0, 0, 0, 0, 0, 0], [17, 2, 1, 0, 1, 0, 0, 1], [17, 1, 0, 1, 0, 0, 0, 0],
                                   [17, 0, 0, 0, 0, 0, 5, 0]])
def test_the_status_state_is_the_decoded_record_s(words):
    """``status_state`` (what every call reads: a clean record told without decoding) says what ``read_status`` does."""
    outcome = read_status(words, 3)
    assert status_state(words, 3) == (outcome.missing_ranks, bool(outcome.aborted_ranks))


def test_step_words_are_monotone_and_tell_kinds_apart():
    assert max(STEP_KINDS.values()) < 4 and len(set(STEP_KINDS.values())) == len(STEP_KINDS)
    words = [step_word(seq, kind) for seq in range(1, 5) for kind in STEP_KINDS]
    assert words == sorted(words) and len(set(words)) == len(words)
    assert all(step_word(seq, kind) < (seq + 1) << 2 for seq in range(1, 5) for kind in STEP_KINDS)


def test_abort_records_round_trip_and_cut_long_reasons():
    table = np.zeros((3, ABORT_WORDS), np.int64)
    assert decode(table) == []
    table[2] = encode("combine", 4, "timed out after 3 s waiting for ranks [0]")
    table[0] = encode("", 0, "x" * (REASON_BYTES + 10))
    assert decode(table) == [(0, "construction", "x" * REASON_BYTES),
                             (2, "combine #4", "timed out after 3 s waiting for ranks [0]")]


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_peer_abort_record_is_raised_by_the_next_call_and_close_releases_locally():
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))
    nv = simulated_backend(geo, True, False)
    transport = nv.transport
    x = np.ones((4, geo.hidden), np.float32)
    idx = uniform_routing(4, geo.num_experts, geo.num_topk, seed=1).topk_idx
    out = dispatch(nv, x, idx, None, None, False, 1, False, True, None)
    transport.aborts[0] = encode("dispatch", 2, "timed out after 3 s waiting for ranks [1]")  # as a peer posts it
    with pytest.raises(PeerAbortedError, match=r"rank 0: cannot dispatch: rank 0 gave up at dispatch #2 "
                                               r"\(timed out after 3 s waiting for ranks \[1\]\)") as info:
        dispatch(nv, x, idx, None, None, False, 1, False, True, None)
    assert info.value.records == ((0, "dispatch #2", "timed out after 3 s waiting for ranks [1]"),)
    with pytest.raises(BufferUnusableError, match="rank 0 gave up at dispatch #2"):
        combine(nv, out.recv_x, out.handle, None, ())
    nv.close()
    assert transport.closed_collectively is False and nv.transport is None


class _CountingBoard:
    """An abort board that counts its device reads."""

    def __init__(self, num_ranks: int):
        self.table = np.zeros((num_ranks, ABORT_WORDS), np.int64)
        self.reads = 0
        self.posted = []

    def post_abort(self, record) -> None:
        self.posted.append(record)

    def abort_table(self):
        self.reads += 1
        return self.table


def _nothing(seq: int) -> int:
    return seq


def test_a_step_reads_the_abort_records_on_entry_only_when_asked():
    """``Steps.run(read_board=False)`` (a ``cpu_sync=False`` step whose last wait saw no record) reads no record;
    ``read_board=True`` reads them and raises a peer's record before the step's body runs."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    board.table[1] = encode("combine", 1, "timed out after 3 s waiting for ranks [0]")
    assert steps.run("dispatch", False, _nothing) == 1 and board.reads == 0
    ran = []
    with pytest.raises(PeerAbortedError, match=r"rank 0: cannot combine: rank 1 gave up at combine #1"):
        steps.run("combine", True, ran.append)
    assert board.reads == 1 and steps.unusable and not ran and not board.posted
    with pytest.raises(BufferUnusableError, match="cannot dispatch: rank 1 gave up at combine #1"):
        steps.run("dispatch", False, ran.append)
    assert board.reads == 1 and not ran


def test_a_step_whose_body_raises_leaves_the_buffer_unusable_and_posts_its_record():
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)

    def fails(seq: int, what: str) -> None:
        raise RuntimeError(f"{what} at step {seq}")

    with pytest.raises(RuntimeError, match="kernel at step 1"):
        steps.run("dispatch", False, fails, "kernel")
    assert steps.unusable == "dispatch #1 failed midway" and len(board.posted) == 1
    assert decode(np.stack([board.posted[0], np.zeros(ABORT_WORDS, np.int64)])) == [
        (0, "dispatch #1", "failed midway (RuntimeError: kernel at step 1)")]
    with pytest.raises(BufferUnusableError, match="cannot combine: dispatch #1 failed midway"):
        steps.run("combine", True, _nothing)
    assert steps.seq == 1


def test_the_receive_part_of_a_split_step_is_guarded_as_a_whole_step():
    """``Steps.run`` numbers a split step and runs its send part, which returns the receive part;
    ``Steps.resume`` runs that later: a clean one returns its value, a failing one marks the buffer unusable and
    posts the record of that step, as a failing body does."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    receive = steps.run("dispatch", False, lambda seq: lambda scale: seq * scale)
    assert steps.latest == "dispatch #1" and steps.resume("dispatch", receive, 10) == 10 and not steps.unusable

    def fails(reason: str) -> None:
        raise RuntimeError(reason)

    assert steps.run("combine", False, lambda seq: fails) is fails and steps.latest == "combine #1"
    with pytest.raises(RuntimeError, match="lost"):
        steps.resume("combine", fails, "lost")
    assert steps.unusable == "combine #1 failed midway"
    assert decode(np.stack([board.posted[0], np.zeros(ABORT_WORDS, np.int64)])) == [
        (0, "combine #1", "failed midway (RuntimeError: lost)")]


def test_a_wait_every_rank_arrived_at_reads_the_abort_records_only_when_it_saw_one():
    """``Steps.after_wait``: no device read when every rank arrived and the wait saw no record (the nvshmem
    wait kernel's mapped status); a read when the wait saw one, or when a rank is missing."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    steps.run("dispatch", False, lambda seq: steps.after_wait("dispatch", [], seen=False))
    assert board.reads == 0 and not steps.unusable
    board.table[1] = encode("dispatch", 1, "failed midway")
    with pytest.raises(PeerAbortedError, match=r"rank 0: dispatch #1: rank 1 gave up at dispatch #1"):
        steps.after_wait("dispatch", [], seen=True)
    assert board.reads == 1
    board.table[1], board.reads = 0, 0
    late = Steps(0, 3.0, board)
    with pytest.raises(TimeoutError, match=r"waiting for ranks \[1\]"):
        late.after_wait("dispatch", [1], seen=False)
    assert board.reads == 1


def _count_board_reads(transport) -> list:
    """Count the calls of ``transport.abort_table`` (the device reads of the abort records) in ``reads[0]``."""
    reads, table = [0], transport.abort_table

    def counted():
        reads[0] += 1
        return table()

    transport.abort_table = counted
    return reads


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_an_eager_step_reads_the_abort_records_only_when_the_mapped_status_shows_one():
    """No device read of the abort records by a clean ``cpu_sync=True`` dispatch, cached dispatch or combine (not on
    entry, not after the poll): the mapped status the GPU wait fills says whether there is one to read. A close reads
    them once, on entry (a peer that gave up is reported as "cannot close", without a wait)."""
    be = simulated_backend(SMALL_GEO, True, False)
    reads = _count_board_reads(be.transport)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    out = dispatch(be, x, SMALL_IDX, None, None, False, 1, False, True, None)
    dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    combine(be, out.recv_x, out.handle, None, ())
    assert reads[0] == 0
    be.close()
    assert reads[0] == 1 and be.transport is None


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_record_the_wait_saw_is_raised_after_the_host_wait():
    """A peer's record posted while this rank waits (the wait kernel copies it into the mapped status) makes
    the ``cpu_sync=True`` step raise ``PeerAbortedError`` after its host wait: the step's rows are not used."""
    be = simulated_backend(SMALL_GEO, True, False)
    transport = be.transport
    exchange = transport.exchange

    def peer_gives_up_meanwhile(*args):
        exchange(*args)
        transport.aborts[0] = encode("dispatch", 1, "failed midway")

    transport.exchange = peer_gives_up_meanwhile
    reads = _count_board_reads(transport)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    with pytest.raises(PeerAbortedError, match=r"rank 0: dispatch #1: rank 0 gave up at dispatch #1"):
        dispatch(be, x, SMALL_IDX, None, None, False, 1, False, True, None)
    assert reads[0] == 1 and be.runner.steps.unusable
