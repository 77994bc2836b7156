"""The nvshmem backend's forwarded steps on the multi-rank fake GPU (``helpers.fake_world``: four backends in one
process, the kernels in the Numba CUDA simulator) against the mpi backend of this ``mpirun -n 4`` job, both as 2
nodes of 2 with ``forwarding=True`` (and flat, ``forwarding=False``, the fake's ranks all through stores): every rank
makes the same calls on an mpi Buffer, rank 0 gathers their outputs and runs the four fake ranks on the same inputs,
and each fake rank's outputs (a new routing, its weighted combine, a replay of its handle) are the mpi rank's byte
for byte, handles included, and so are its scale-out rows (``traffic()``, per operation)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.collective import TIMEOUT_S
from helpers.fake_gpu import combine, dispatch
from helpers.fake_world import World, random_sources, run_ranks, world_backends
from helpers.options import current
from helpers.oracle import COMM, RANK, WORLD
from helpers.same_outputs import assert_same_outputs

import ep_comm
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED

SCALEUP = 2
TOKENS = (4, 0, 5, 3)
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300),
              pytest.mark.skipif(WORLD != 4 or current().backend != "mpi" or not SIMULATED,
                                 reason="4 ranks of the mpi backend, the nvshmem kernels in the simulator")]


def mpi_calls(geo: Geometry, src, expand: bool, forwarding: bool) -> tuple:
    """``(outputs, scale-out rows)``: this rank's new routing, its combine (weighted as dispatched) and a replay of its
    handle with another payload, on an mpi Buffer in nodes of 2, ``forwarding`` or flat; its ``traffic()`` after the
    close."""
    x, idx, w = src.x[RANK], src.topk_idx[RANK], src.weights[RANK]
    with ep_comm.Buffer(COMM, num_experts=geo.num_experts, hidden=geo.hidden, num_topk=geo.num_topk,
                        num_max_tokens_per_rank=geo.max_tokens, dtype=geo.dtype.name, backend="mpi",
                        deterministic=True, timeout_s=TIMEOUT_S, scaleup_ranks=SCALEUP, forwarding=forwarding) as buf:
        first = buf.dispatch(x, idx, w, expand=expand, expert_alignment=2 if expand else 1, zero_padding=expand)
        summed = buf.combine(first.recv_x, first.handle, topk_weights=first.recv_topk_weights)
        replay = buf.dispatch((x.astype(np.float32) * 2 + 1).astype(x.dtype), handle=first.handle)
    return [first, summed, replay], buf.traffic().scaleout_rows


def fake_calls(be, rank: int, src, expand: bool) -> list:
    """:func:`mpi_calls` on fake rank ``rank``'s nvshmem backend."""
    x, idx, w = src.x[rank], src.topk_idx[rank], src.weights[rank]
    args = (expand, 2 if expand else 1, expand, True)
    first = dispatch(be, x, idx, w, None, *args, None)
    summed = combine(be, first.recv_x, first.handle, first.recv_topk_weights, ())
    return [first, summed, dispatch(be, (x.astype(np.float32) * 2 + 1).astype(x.dtype), None, w, first.handle, *args,
                                    None)]


@pytest.mark.parametrize("forwarding", [True, False], ids=["forwarded", "flat"])
@pytest.mark.parametrize("dtype, expand", [("bfloat16", False), ("float32", True)], ids=["compact", "expand"])
def test_the_fake_nvshmem_world_in_two_nodes_is_the_mpi_backend(dtype, expand, forwarding):
    geo = Geometry(WORLD, 8, 16, 3, 5, payload_dtype(dtype))
    src = random_sources(geo, TOKENS, weighted=True, seed=41 + expand)
    gathered = COMM.gather(mpi_calls(geo, src, expand, forwarding), root=0)
    if RANK != 0:
        return
    world = World(geo, SCALEUP, forwarding=forwarding, transport="auto" if forwarding else "stores")
    backends = world_backends(world)
    fake = run_ranks(world, [lambda r=r: fake_calls(backends[r], r, src, expand) for r in range(WORLD)])
    assert sum(sum(rows) for _, rows in gathered) > 0, "the routing crosses the nodes"
    for rank, ((want, rows), got) in enumerate(zip(gathered, fake)):
        assert backends[rank].transport.inbox_signals_sent == 3 * forwarding, "every forwarded step used the inboxes"
        assert_same_outputs(want, got)
        assert backends[rank].traffic().scaleout_rows == rows, f"rank {rank}'s scale-out rows"
