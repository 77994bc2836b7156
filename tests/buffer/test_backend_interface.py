"""The backend interface on CPU: both backends are ``Backend``s, ``Buffer(transport=..., profile=...)``'s
rules, and the mpi backend's profile table. (The nvshmem backend's side runs in ``tests/nvshmem_host/``.)"""
from __future__ import annotations

import gc
import re
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import ep_comm
from ep_comm.backends.interface import Backend
from ep_comm.backends.mpi import MpiBackend
from ep_comm.backends.mpi.flat import FlatRoute
from ep_comm.backends.profile import ProfileRow
from ep_comm.contract.checks import check_profile, check_transport
from ep_comm.contract.choices import TRANSPORTS
from ep_comm.testing.routing import uniform_routing

SHAPE = dict(num_experts=8, hidden=16, num_topk=2, num_max_tokens_per_rank=8, dtype="float32")


def routing(num_tokens: int, seed: int) -> np.ndarray:
    """``[T, K]`` int64: each token picks distinct experts."""
    return uniform_routing(num_tokens, SHAPE["num_experts"], SHAPE["num_topk"], seed=seed).topk_idx


def test_the_mpi_backend_is_a_backend():
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi") as buf:
        assert isinstance(buf._backend, Backend) and isinstance(buf._backend, MpiBackend)


def test_the_mpi_backend_composes_its_parts_over_one_context():
    """Composition, not mixins (issue 40): the backend inherits nothing; its protocol runs its steps on the
    backend's runner, over its window, and sends over the flat route on one node."""
    assert MpiBackend.__bases__ == (object,)
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi") as buf:
        backend = buf._backend
        ctx = backend.protocol.ctx
        assert ctx.runner is backend.runner and ctx.window is backend.window is backend.runner.window
        assert isinstance(backend.protocol.route, FlatRoute) and backend.protocol.route.ctx is ctx


@pytest.mark.parametrize("bad", ["store", "PUTS", "", None, 1, ("stores",)])
def test_a_transport_outside_the_choices_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="^" + re.escape(f"transport={bad!r}: must be one of {TRANSPORTS}")):
        check_transport(bad)
    with pytest.raises(ValueError, match=re.escape(f"transport={bad!r}")):
        ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", transport=bad)


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_a_profile_that_is_not_a_bool_is_a_type_error_naming_it(bad):
    with pytest.raises(TypeError, match="^" + re.escape(f"profile={bad!r}: must be True or False, got ")):
        check_profile(bad)
    with pytest.raises(TypeError, match=re.escape(f"profile={bad!r}")):
        ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", profile=bad)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_transport_has_no_effect_on_mpi(transport):
    idx = routing(6, seed=1)
    x = np.arange(6 * SHAPE["hidden"], dtype=np.float32).reshape(6, SHAPE["hidden"])
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", transport=transport, deterministic=True) as buf:
        assert buf.transport is None
        out = buf.dispatch(x, idx)
        np.testing.assert_array_equal(buf.combine(out.recv_x, out.handle).x, x)


def test_the_mpi_profile_table_has_host_times_of_every_phase_and_survives_close():
    idx = routing(6, seed=2)
    x = np.ones((6, SHAPE["hidden"]), np.float32)
    buf = ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", profile=True)
    assert buf.profile_table() == []
    for _ in range(3):
        out = buf.dispatch(x, idx)
        buf.combine(out.recv_x, out.handle)
    table = buf.profile_table()
    assert all(isinstance(row, ProfileRow) for row in table)
    phases = {(row.op, row.phase): row for row in table}
    assert set(phases) == {("dispatch", p) for p in ("total", "scatter", "signal+wait", "receive")} | \
        {("combine", p) for p in ("total", "send", "signal+wait", "reduce")}
    assert all(row.calls == 3 and row.host_us_p50 > 0 and row.gpu_us_p50 is None for row in table)
    assert phases["dispatch", "total"].host_us_p50 >= phases["dispatch", "signal+wait"].host_us_p50
    buf.close()
    closed = {(row.op, row.phase): row.calls for row in buf.profile_table()}
    assert closed == {**{key: 3 for key in phases}, ("close", "total"): 1, ("close", "signal+wait"): 1}


def test_the_profile_table_of_a_buffer_without_profiling_says_how_to_get_one():
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi") as buf:
        with pytest.raises(RuntimeError, match=re.escape("Buffer(..., profile=True)")):
            buf.profile_table()


def _dispatched(buf: ep_comm.Buffer, seed: int = 0):
    x = np.ones((6, SHAPE["hidden"]), np.float32)
    return x, buf.dispatch(x, routing(6, seed))


def test_a_handle_of_another_geometry_is_refused_on_every_call_and_one_that_passed_is_refused_after_close():
    """A Buffer checks a handle once (then remembers it by weak reference): a handle of another geometry
    raises the same ValueError on every dispatch and combine, and after ``close`` every handle is refused."""
    with ep_comm.Buffer(MPI.COMM_SELF, **dict(SHAPE, num_max_tokens_per_rank=SHAPE["num_max_tokens_per_rank"] + 8),
                        backend="mpi") as other:
        _, foreign = _dispatched(other)
    buf = ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi")
    x, out = _dispatched(buf)
    want = (f"handle comes from a dispatch of a Buffer with num_max_tokens_per_rank="
            f"{SHAPE['num_max_tokens_per_rank'] + 8} (this Buffer: {SHAPE['num_max_tokens_per_rank']}): a handle "
            "replays and combines only on a Buffer of the geometry it was made with")
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            buf.dispatch(x, handle=foreign.handle)
        assert str(info.value) == want
        with pytest.raises(ValueError) as info:
            buf.combine(foreign.recv_x, foreign.handle)
        assert str(info.value) == want
        buf.combine(out.recv_x, out.handle)
        buf.dispatch(x, handle=out.handle)
    with pytest.raises(TypeError, match="handle must be an EPHandle from dispatch, got str"):
        buf.combine(out.recv_x, "handle")
    buf.close()
    for call in (lambda: buf.dispatch(x, handle=out.handle), lambda: buf.combine(out.recv_x, out.handle)):
        with pytest.raises(RuntimeError, match="this Buffer is closed"):
            call()


def test_a_buffer_remembers_the_handles_it_checked_without_keeping_them_alive():
    """The record of a checked handle holds it weakly and is dropped with the handle."""
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi") as buf:
        x, out = _dispatched(buf)
        buf.combine(out.recv_x, out.handle)
        handle = weakref.ref(out.handle)
        assert list(buf._checked_handles.seen) == [id(out.handle)]
        del out
        gc.collect()
        assert handle() is None and buf._checked_handles.seen == {}
