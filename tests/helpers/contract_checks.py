"""This rank's dispatch outputs in the collective suites of ``tests/mpi``, checked against the contract: the shared
checker (``ep_comm.testing.check``, the NumPy reference) on the outputs, and the reference's received rows and
per-expert counts against the plain loops of ``helpers.oracle``."""
from __future__ import annotations

from ep_comm.testing.check import DispatchOptions, HostDispatch, Sources, check_dispatch, expected_receive
from helpers.oracle import RANK, World


def check_dispatch_outputs(world: World, out, opts: DispatchOptions) -> None:
    """The shared checker on this rank's outputs of a dispatch of ``world`` with ``opts``; the reference's
    received (source rank, token) pairs and per-expert rows agree with the oracle's."""
    sources = Sources(world.num_experts, world.max_tokens, world.topk_idx, world.x, world.weights)
    problems = check_dispatch(sources, RANK, opts, HostDispatch.of(out))
    assert not problems, problems
    want = expected_receive(sources, RANK)
    assert [divmod(int(o), world.max_tokens) for o in want.origin] == world.received(RANK), "reference != oracle"
    per_expert = [len(world.expert_rows(RANK, e)) for e in range(world.experts_per_rank)]
    assert want.expert_counts(world.experts_per_rank).tolist() == per_expert, "reference != oracle"


def check_compact(world: World, out, deterministic: bool) -> None:
    """:func:`check_dispatch_outputs` of a compact dispatch with weights."""
    check_dispatch_outputs(world, out, DispatchOptions(weighted=True, deterministic=deterministic))
