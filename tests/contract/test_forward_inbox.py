"""``Buffer(forwarding=...)`` in one process: the forwarding inbox's byte layout (``ep_comm.contract.forward_inbox``),
the order a forwarder writes in, the argument's check, and the nvshmem backend's refusal (without a GPU). The
protocol itself runs under ``mpirun`` in ``tests/mpi/test_forwarding.py``."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import ep_comm
from ep_comm._buffer_arguments import check_constructor_arguments
from ep_comm.backends.interface import BackendSettings, OperationRows, Traffic
from ep_comm.backends.mpi.flat import FlatRoute
from ep_comm.backends.nvshmem import NvshmemBackend
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.forward_inbox import (
    HEADER_WORDS,
    ForwardInbox,
    combine_send_views,
    inbox_views,
    relay_meta,
    slot_order,
)
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import SymmetricLayout

SYM = SymmetricLayout(num_ranks=8, max_tokens=5, hidden=24, num_topk=3, itemsize=2, num_local_experts=2)


def test_the_inbox_follows_the_symmetric_buffer_in_disjoint_regions():
    inbox = ForwardInbox(SYM, scaleup_ranks=4)
    assert inbox.relay_words == SYM.meta_words + 4
    regions = [  # (first byte, end) of every block of every region, both parities
        (at(p, b), at(p, b) + size)
        for at, size in ((inbox.header_at, 8 * HEADER_WORDS), (inbox.count_at, 8 * SYM.count_words),
                         (inbox.row_at, SYM.max_tokens * SYM.row_bytes),
                         (inbox.meta_at, SYM.max_tokens * inbox.relay_words * 4),
                         (inbox.combine_meta_at, SYM.max_tokens * SYM.meta_words * 4))
        for p in (0, 1) for b in range(SYM.num_ranks)]
    regions.append((inbox.signal_offset, inbox.signal_offset + 8 * SYM.num_ranks))
    regions.sort()
    assert regions[0][0] == SYM.total_bytes and regions[-1][1] <= inbox.total_bytes
    assert all(end <= start for (_, end), (start, _) in zip(regions, regions[1:]))
    # a sender node's blocks are consecutive: its count words for the node's ranks go in one put
    assert inbox.count_at(1, inbox.block(1, 2)) == inbox.count_at(1, inbox.block(1, 0)) + 2 * 8 * SYM.count_words


def test_the_combine_send_views_write_the_block_and_stay_in_the_allocation():
    """``combine_send_views``: C-contiguous views of the symmetric shapes in which ``[parity, me, slot]`` is the
    block's ``[parity, slot]`` (rows, combine meta rows, header), for every rank and block, inside the buffer."""
    inbox = ForwardInbox(SYM, scaleup_ranks=4)
    word = np.dtype(np.uint16)
    for me in range(SYM.num_ranks):
        for block in range(SYM.num_ranks):
            buffer = np.zeros(inbox.total_bytes, np.uint8)
            views = combine_send_views(buffer, inbox, me, block, word)
            assert all(v.flags.c_contiguous for v in views)
            assert views.rows.shape == (2, SYM.num_ranks, SYM.max_tokens, SYM.row_bytes // 2)
            assert views.meta.shape == (2, SYM.num_ranks, SYM.max_tokens, SYM.meta_words)
            assert views.header.shape == (2, SYM.num_ranks, HEADER_WORDS)
            boxes = inbox_views(buffer, inbox, word)
            for parity in (0, 1):
                views.rows[parity, me, 3] = 7 + parity
                views.meta[parity, me, 4] = 9 + parity
                views.header[parity, me] = (5, parity)
                assert (boxes.rows[parity, block, 3] == 7 + parity).all()
                assert (boxes.combine_meta[parity, block, 4] == 9 + parity).all()
                assert boxes.header[parity, block].tolist() == [5, parity]
            written = np.zeros_like(buffer)  # nothing else written: the block's own bytes only
            for parity in (0, 1):
                for at, size in ((inbox.row_at(parity, block) + 3 * SYM.row_bytes, SYM.row_bytes),
                                 (inbox.combine_meta_at(parity, block) + 16 * SYM.meta_words, 4 * SYM.meta_words),
                                 (inbox.header_at(parity, block), 8 * HEADER_WORDS)):
                    written[at: at + size] = buffer[at: at + size]
            np.testing.assert_array_equal(buffer, written, err_msg=f"me {me}, block {block}")


def test_a_forwarder_writes_in_slot_order_whatever_the_arrival_order():
    meta = np.arange(5 * SYM.meta_words, dtype=np.int32).reshape(5, SYM.meta_words)
    slots = np.array([[2, -1], [0, 0], [-1, -1], [1, 1], [3, -1]])
    relay = relay_meta(meta, slots)
    assert relay.dtype == np.int32 and relay.shape == (5, SYM.meta_words + 2)
    np.testing.assert_array_equal(relay[:, : SYM.meta_words], meta)
    np.testing.assert_array_equal(slot_order(relay[:, SYM.meta_words]), [1, 3, 0, 4])
    np.testing.assert_array_equal(slot_order(relay[:, SYM.meta_words + 1]), [1, 3])
    shuffled = [4, 2, 0, 3, 1]  # the same rows arrived in another order: the same rows land in the same slots
    np.testing.assert_array_equal(np.array(shuffled)[slot_order(relay[shuffled, SYM.meta_words])], [1, 3, 0, 4])


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_forwarding_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=f"^forwarding={bad!r}: must be True or False"):
        check_constructor_arguments(4, 8, 16, 2, 4, 1.0, None, "auto", 2, bad, False)
    check_constructor_arguments(4, 8, 16, 2, 4, 1.0, None, "auto", 2, np.bool_(True), False)


def test_one_node_forwards_nothing():
    shape = dict(num_experts=4, hidden=8, num_topk=2, num_max_tokens_per_rank=4, backend="mpi")
    with ep_comm.Buffer(MPI.COMM_SELF, **shape, forwarding=True) as buf:
        assert buf.forwarding and buf._backend.inbox is None and isinstance(buf._backend.protocol.route, FlatRoute)
        idx = np.array([[0, 3], [1, -1]])
        out = buf.dispatch(np.ones((2, 8), np.float32).astype(buf.geometry.dtype), idx)
        buf.combine(out.recv_x, out.handle)
        assert buf.traffic() == Traffic(OperationRows(dispatch=0, combine=0))


def test_the_nvshmem_backend_refuses_forwarding_over_puts_before_allocating_anything():
    def allocate(*args, **kwargs):
        raise AssertionError("the transport was built before forwarding was refused")

    geo = Geometry(4, 4, 8, 1, 4, payload_dtype("float32"))
    settings = BackendSettings(True, 1.0, transport="puts", scaleup_ranks=2, forwarding=True)
    with pytest.raises(ValueError, match=r"^forwarding=True with 2 nodes \(scaleup_ranks=2 of 4 ranks\) and "
                                         r"transport='puts': on nvshmem the inbox's staging blocks and puts .* are "
                                         r"not built; use transport='auto'"):
        NvshmemBackend.open(MPI.COMM_SELF, geo, settings, allocate, allocate)


def test_the_nvshmem_backend_builds_a_forwarding_transport_with_the_inbox():
    """Forwarding across nodes with ``transport="auto"``: the transport is given the inbox after the symmetric buffer
    (the heap holds ``ForwardInbox.total_bytes``) and the ranks of the other node as its puts peers."""
    class Built(Exception):
        pass

    def allocate(comm, sym, word, puts_to, inbox):
        raise Built(puts_to, inbox)

    geo = Geometry(4, 4, 8, 1, 4, payload_dtype("float32"))
    settings = BackendSettings(True, 1.0, scaleup_ranks=2, forwarding=True)
    with pytest.raises(Built) as built:
        NvshmemBackend.open(MPI.COMM_SELF, geo, settings, allocate, allocate)
    puts_to, inbox = built.value.args
    assert puts_to == (2, 3) and inbox.scaleup_ranks == 2 and inbox.sym.num_ranks == 4


@pytest.mark.parametrize("ranks, scaleup_ranks", [(1, None), (4, None), (1, 1)])
def test_the_nvshmem_backend_takes_forwarding_in_one_node(ranks, scaleup_ranks):
    """One node forwards nothing (the forwarded results are the flat ones, as on mpi): ``forwarding=True`` passes the
    refusal and the backend goes on to build its transport."""
    class Built(Exception):
        pass

    def allocate(*args, **kwargs):
        raise Built

    geo = Geometry(ranks, 4, 8, 1, 4, payload_dtype("float32"))
    settings = BackendSettings(True, 1.0, scaleup_ranks=scaleup_ranks, forwarding=True)
    with pytest.raises(Built):
        NvshmemBackend.open(MPI.COMM_SELF, geo, settings, allocate, allocate)
