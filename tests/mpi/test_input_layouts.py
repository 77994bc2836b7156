"""Inputs of any memory layout, and "no expert" written as any negative id, on every rank of an ``mpirun`` job.

A call's result must not depend on how its inputs are laid out in memory (row-major, column-major, a strided view,
a view one element past an allocation's start) nor on which negative value marks a masked entry (docs/design.md,
"Dispatch": any negative id is "no expert"). On the nvshmem backend the later calls of a shape replay recorded
launches (and take the prepared path), which must never replay the launches of another layout; the forwarded route
carries ids in 32-bit meta words. The sequences and their assertions: ``helpers.layouts``. Collective: every test
runs on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.collective import make_buffer, shared_buffers, to_device
from helpers.layouts import IDX_LAYOUTS, bias_pair_sequence, in_layout, layout_sequence, negative_id_sequence
from helpers.options import current
from helpers.oracle import RANK, make_world
from helpers.same_outputs import assert_same

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def buffers():
    """One buffer per geometry and ``deterministic``, shared by the tests of this module."""
    with shared_buffers() as get:
        yield get


def _inputs(world) -> tuple:
    """``(x, topk_idx, topk_weights, bias)`` of this rank on the backend's device, C-contiguous."""
    bias = np.random.default_rng(RANK).standard_normal((len(world.x[RANK]), world.hidden)).astype(np.float32)
    return tuple(to_device(a) for a in (world.x[RANK], world.topk_idx[RANK], world.weights[RANK], bias))


@pytest.mark.parametrize("cpu_sync", [True, False], ids=["cpu_sync", "no_sync"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_calls_of_one_shape_with_input_layouts_changing_between_them(buffers, expand, cpu_sync):
    world = make_world("masked", seed=45)
    layout_sequence(buffers(world), _inputs(world), expand, cpu_sync)


def test_the_layout_call_reads_every_layout_of_its_ids(buffers):
    world = make_world("masked", seed=46)
    buf = buffers(world)
    idx = to_device(world.topk_idx[RANK])
    want = buf.get_dispatch_layout(idx)
    for layout in IDX_LAYOUTS:
        got = buf.get_dispatch_layout(in_layout(idx, layout))
        for field in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
            assert_same(f"{layout}: {field}", getattr(want, field), getattr(got, field))


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_any_negative_id_is_no_expert(buffers, dtype, expand):
    world = make_world("masked", seed=47)
    x, _, weights, _ = _inputs(world)
    negative_id_sequence(buffers(world), x, world.topk_idx[RANK], weights, dtype, expand, to_device)


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_bias_pair_of_one_array_in_some_calls_of_a_shape_combines_each_pair(buffers, expand):
    """``bias=(b, b)`` first, then pairs of two arrays, on one Buffer (``helpers.layouts.bias_pair_sequence``): each
    combine gives the bytes of the same pair copied apart on a fresh Buffer (whose calls never share an array)."""
    world = make_world("masked", seed=49)
    got = bias_pair_sequence(buffers(world), _inputs(world), expand, apart=False)
    with make_buffer(world) as fresh:
        want = bias_pair_sequence(fresh, _inputs(world), expand, apart=True)
    for i, (a, b) in enumerate(zip(want, got)):
        assert_same(f"combine {i}", a, b)


@pytest.mark.skipif(current().backend != "mpi", reason="host arrays: the mpi backend's inputs")
def test_a_numpy_matrix_of_ids_is_read_as_its_array(buffers):
    """``numpy.matrix`` (an ndarray subclass whose rows stay 2-D) routes as the plain array of the same ids."""
    world = make_world("masked", seed=48)
    buf = buffers(world)
    x, idx, weights, _ = _inputs(world)
    want = buf.get_dispatch_layout(idx)
    got = buf.get_dispatch_layout(np.asmatrix(idx))
    for field in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        assert_same(f"matrix: {field}", getattr(want, field), getattr(got, field))
    plain = buf.dispatch(x, idx, weights)
    matrix = buf.dispatch(x, np.asmatrix(idx), np.asmatrix(weights))
    for field in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
        assert_same(f"matrix: {field}", getattr(plain, field), getattr(matrix, field))
