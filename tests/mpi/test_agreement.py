"""The construction check (``ep_comm.contract.agreement``): ranks that pass different Buffer arguments, or a rank whose own
arguments are invalid, make every rank raise before anything is allocated; the world stays in step. Collective;
each test under a hard timeout, so a check that leaves a rank waiting fails instead of hanging."""
from __future__ import annotations

import pytest
from helpers.collective import dispatch, make_buffer
from helpers.options import current
from helpers.oracle import RANK, WORLD, bits, expected_compact_combine, make_world

import ep_comm
from ep_comm.contract.arrays import to_host

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]
ODD = WORLD - 1  # the rank that passes something else
BASE = dict(num_experts=4 * WORLD, hidden=8, num_topk=2, num_max_tokens_per_rank=4, dtype="float32",
            deterministic=False, scaleup_ranks=None, forwarding=False)


def ranks_text(value_of_others, value_of_odd) -> str:
    return f"{value_of_others!r} on ranks {list(range(WORLD - 1))}, {value_of_odd!r} on ranks [{ODD}]"


def session_base() -> dict:
    """``BASE`` with the session's backend arguments (``--scaleup-ranks`` among them)."""
    return dict(BASE, **current().buffer_kwargs())


def build(**changed):
    """A Buffer of :func:`session_base` on every rank, ``changed`` on rank ``ODD`` only."""
    kwargs = session_base()
    if RANK == ODD:
        kwargs.update(changed)
    return ep_comm.Buffer(**kwargs)


def assert_world_still_works() -> None:
    """Nothing was left half made: a Buffer of the same arguments everywhere is exact."""
    world = make_world("uniform", dtype="float32")
    with make_buffer(world) as buf:
        out = dispatch(buf, world)
        res = buf.combine(out.recv_x, out.handle)
        assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


@pytest.mark.parametrize("field, other", [("hidden", 16), ("dtype", "bfloat16"), ("deterministic", True),
                                          ("num_max_tokens_per_rank", 8), ("num_topk", 3),
                                          ("num_experts", 8 * WORLD), ("scaleup_ranks", WORLD),
                                          ("forwarding", not session_base()["forwarding"])])
def test_a_rank_with_another_argument_makes_every_rank_raise_naming_it(field, other):
    with pytest.raises(ValueError) as info:
        build(**{field: other})
    assert str(info.value) == (f"Buffer: arguments differ between ranks ({field}: {ranks_text(session_base()[field], other)}): "
                               "every rank must pass the same; no rank made the Buffer")
    assert_world_still_works()


def test_every_field_that_differs_is_named():
    with pytest.raises(ValueError) as info:
        build(hidden=16, num_sms=4)
    assert str(info.value) == (f"Buffer: arguments differ between ranks (hidden: {ranks_text(8, 16)}; "
                               f"num_sms: {ranks_text(None, 4)}): every rank must pass the same; "
                               "no rank made the Buffer")
    assert_world_still_works()


@pytest.mark.parametrize("bad, exc, own", [
    (dict(hidden=0), ValueError, "hidden=0: must be a positive integer"),
    (dict(dtype="int8"), TypeError, "dtype='int8' is not supported: use one of ['bfloat16', 'float16', 'float32']"),
    (dict(timeout_s=-1), ValueError, "timeout_s=-1: must be a positive number of seconds"),
    (dict(scaleup_ranks=0), ValueError, f"scaleup_ranks=0: must be >= 1 and divide the rank count {WORLD} (nodes of "
                                        "equal size, consecutive ranks)"),
    (dict(forwarding=1), TypeError, "forwarding=1: must be True or False, got int"),
])
def test_a_rank_with_invalid_arguments_does_not_leave_its_peers_waiting(bad, exc, own):
    """The invalid rank raises its own error; its peers, which reached the check, raise a ValueError naming it."""
    with pytest.raises(ValueError if RANK != ODD else exc) as info:
        build(**bad)
    if RANK == ODD:
        assert str(info.value) == own
    else:
        assert str(info.value) == (f"Buffer: the arguments of 1 rank(s) are invalid (rank {ODD}: {exc.__name__}: "
                                   f"{own}); no rank made the Buffer")
    assert_world_still_works()
