"""Ranks in (virtual) nodes (``ep_comm.contract.topology``), ``Buffer(scaleup_ranks=...)``'s rules and which
transport ``"auto"`` picks on the nvshmem backend."""
from __future__ import annotations

import pytest
from mpi4py import MPI

import ep_comm
from ep_comm._buffer_arguments import check_constructor_arguments
from ep_comm.backends.interface import BackendSettings
from ep_comm.backends.nvshmem.backend import puts_peers
from ep_comm.contract.topology import Topology, check_scaleup_ranks, transport_mode


def test_nodes_of_consecutive_ranks_and_their_forwarders():
    top = Topology.of(8, 4)
    assert top.num_nodes == 2
    assert [top.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [top.local_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert list(top.node_ranks(1)) == [4, 5, 6, 7]
    assert top.in_reach(1, 3) and not top.in_reach(3, 4)
    assert [top.forwarder(6, node) for node in (0, 1)] == [2, 6]
    assert Topology.of(6, None) == Topology(6, 6) and Topology.of(6, None).num_nodes == 1


def test_a_rank_forwards_for_its_forwarders():
    top = Topology.of(6, 2)  # 3 nodes
    assert [top.forwarders(r) for r in range(6)] == [[2, 4], [3, 5], [0, 4], [1, 5], [0, 2], [1, 3]]
    assert all(r in top.forwarders(f) for r in range(6) for f in top.forwarders(r))  # symmetric
    assert Topology.of(4, None).forwarders(1) == []


@pytest.mark.parametrize("bad, exc, message", [
    (0, ValueError, "scaleup_ranks=0: must be >= 1 and divide the rank count 8"),
    (3, ValueError, "scaleup_ranks=3: must be >= 1 and divide the rank count 8"),
    (True, TypeError, "scaleup_ranks=True must be None or an int (ranks per node), got bool"),
    ("4", TypeError, "scaleup_ranks='4' must be None or an int (ranks per node), got str"),
])
def test_scaleup_ranks_must_divide_the_rank_count(bad, exc, message):
    with pytest.raises(exc) as info:
        check_scaleup_ranks(bad, 8)
    assert str(info.value).startswith(message)


def test_stores_cannot_reach_a_second_node():
    with pytest.raises(ValueError, match=r"^transport='stores' with scaleup_ranks=2: .* 4 ranks make 2 nodes: use "
                                         r"transport='auto' or 'puts'$"):
        check_constructor_arguments(4, 8, 16, 2, 4, 1.0, None, "stores", 2, False, False)
    check_constructor_arguments(4, 8, 16, 2, 4, 1.0, None, "stores", 4, False, False)  # one node: stores reach everyone
    check_constructor_arguments(4, 8, 16, 2, 4, 1.0, None, "auto", 2, False, False)


@pytest.mark.parametrize("transport, scaleup_ranks, me, puts, mode", [
    ("auto", None, 1, (), "stores"), ("auto", 4, 2, (), "stores"), ("auto", 2, 1, (2, 3), "stores+puts"),
    ("auto", 2, 2, (0, 1), "stores+puts"), ("auto", 1, 3, (0, 1, 2), "puts"), ("stores", None, 0, (), "stores"),
    ("puts", None, 0, (0, 1, 2, 3), "puts"), ("puts", 4, 3, (0, 1, 2, 3), "puts"),
])
def test_auto_sends_through_puts_exactly_to_the_peers_out_of_reach(transport, scaleup_ranks, me, puts, mode):
    settings = BackendSettings(True, 1.0, transport=transport, scaleup_ranks=scaleup_ranks)
    assert puts_peers(settings, 4, me) == puts
    assert transport_mode(puts, 4, me) == mode


def test_the_buffer_reports_its_nodes_and_the_mpi_backend_has_no_transport():
    shape = dict(num_experts=4, hidden=8, num_topk=2, num_max_tokens_per_rank=4, backend="mpi")
    with ep_comm.Buffer(MPI.COMM_SELF, **shape) as buf:
        assert (buf.scaleup_ranks, buf.transport) == (1, None)
    with ep_comm.Buffer(MPI.COMM_SELF, **shape, scaleup_ranks=1, transport="puts") as buf:
        assert buf.scaleup_ranks == 1
    with pytest.raises(ValueError, match="^scaleup_ranks=2: must be >= 1 and divide the rank count 1"):
        ep_comm.Buffer(MPI.COMM_SELF, **shape, scaleup_ranks=2)
