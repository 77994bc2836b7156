"""Random sequences of eager calls on one Buffer: new routings, replays of earlier handles and combines of earlier
outputs, of a few token counts (so that call shapes recur), each input in a memory layout of its own, a bias of one
array, of two, or of one array twice, weights that are a view of the payload's bytes. On the simulated nvshmem backend
(kernels in the CUDA simulator, recorded calls in check mode: each call of a key must make its first call's launches
but for its roots' pointers, as a replay on a GPU does) every output must be byte for byte the mpi backend's at one
rank for the same sequence. The defects of this kind seen so far (a call replaying the launches of another layout of
its ids; a bias pair of one array recorded for later pairs of two) each needed a particular order of calls of one
shape: here Hypothesis draws the orders (as many sequences as the profile's examples: ``ci`` 150)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, simulated_buffer
from helpers.layouts import in_layout
from helpers.same_outputs import assert_same_outputs
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import ep_comm
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")

LAYOUTS = ("C", "F", "offset", "rows", "columns")
BIASES = ("none", "one", "pair", "same twice")


@dataclass(frozen=True)
class Call:
    """One drawn call: ``op`` new / cached / combine; ``tokens`` of a new routing; ``pick`` the earlier handle (cached)
    or output (combine) it takes, modulo their count; a new routing's mode, ``expert_alignment``, ``zero_padding`` and
    ids' dtype; ``hook``: sent with ``return_recv_hook=True`` and received by calling the hook at once; the layouts of
    its inputs; ``weights`` given, or ``"view"``: a view of the payload's own bytes; ``bias``
    of a combine."""

    op: str
    tokens: int
    seed: int
    pick: int
    expand: bool
    alignment: int
    zero_padding: bool
    ids: str
    cpu_sync: bool
    hook: bool
    weights: str
    bias: str
    x_layout: str
    idx_layout: str
    w_layout: str


calls = st.builds(Call, op=st.sampled_from(("new", "new", "cached", "combine", "combine")), tokens=st.integers(0, 3),
                  seed=st.integers(0, 2**16), pick=st.integers(0, 7), expand=st.booleans(),
                  alignment=st.sampled_from((1, 2)), zero_padding=st.booleans(), ids=st.sampled_from(("int64", "int32")),
                  cpu_sync=st.booleans(), hook=st.booleans(),
                  weights=st.sampled_from(("none", "given", "view")), bias=st.sampled_from(BIASES),
                  x_layout=st.sampled_from(LAYOUTS), idx_layout=st.sampled_from(LAYOUTS),
                  w_layout=st.sampled_from(LAYOUTS))


def _mpi_buffer() -> ep_comm.Buffer:
    """The mpi backend's Buffer of ``SMALL_GEO`` at one rank (the reference)."""
    return ep_comm.Buffer(MPI.COMM_SELF, num_experts=SMALL_GEO.num_experts, hidden=SMALL_GEO.hidden,
                          num_topk=SMALL_GEO.num_topk, num_max_tokens_per_rank=SMALL_GEO.max_tokens,
                          dtype="float32", deterministic=True, backend="mpi")


def _routing(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """``[tokens, K]`` int64 ids of ``SMALL_GEO``: distinct experts per token, some entries -1."""
    ids = np.stack([rng.permutation(SMALL_GEO.num_experts)[:SMALL_GEO.num_topk] for _ in range(tokens)]) if tokens \
        else np.zeros((0, SMALL_GEO.num_topk), np.int64)
    ids[rng.random(ids.shape) < 0.3] = -1
    return ids.astype(np.int64)


def _payload(rng: np.random.Generator, tokens: int, call: Call) -> tuple:
    """``(x [T, H] float32, weights [T, K] float32 or None)`` of ``call`` in its layouts; ``"view"`` weights are the
    first ``T * K`` values of ``x``'s own bytes (C-contiguous ``x``)."""
    x = rng.standard_normal((tokens, SMALL_GEO.hidden)).astype(np.float32)
    if call.weights == "view":
        x = np.ascontiguousarray(x)
        return x, x.reshape(-1)[:tokens * SMALL_GEO.num_topk].reshape(tokens, SMALL_GEO.num_topk)
    weights = rng.random((tokens, SMALL_GEO.num_topk)).astype(np.float32) if call.weights == "given" else None
    return in_layout(x, call.x_layout), in_layout(weights, call.w_layout)


def _bias(rng: np.random.Generator, tokens: int, kind: str) -> Any:
    """A combine's ``bias``: None, one ``[T, H]`` float32 array, a pair of two, or one array twice."""
    one = rng.standard_normal((tokens, SMALL_GEO.hidden)).astype(np.float32)
    return {"none": None, "one": one, "pair": (one, one * np.float32(3) + np.float32(1)), "same twice": (one, one)}[kind]


def _received(out: Any) -> Any:
    """A call's output: ``out``, or what its receive hook returns."""
    return out() if isinstance(out, ep_comm.RecvHook) else out


def run_sequence(buf: ep_comm.Buffer, sequence: List[Call]) -> list:
    """Make ``sequence``'s calls on ``buf``; every output, in call order (a call with no earlier handle or output to
    take is skipped, the same on every backend)."""
    dispatched: List[Any] = []
    outputs: list = []
    for call in sequence:
        rng = np.random.default_rng(call.seed)
        out: Optional[Any] = None
        if call.op == "new":
            x, weights = _payload(rng, call.tokens, call)
            idx = in_layout(_routing(rng, call.tokens).astype(call.ids), call.idx_layout)
            out = buf.dispatch(x, idx, weights, expand=call.expand, expert_alignment=call.alignment,
                               zero_padding=call.zero_padding, cpu_sync=call.cpu_sync, return_recv_hook=call.hook)
        elif call.op == "cached" and dispatched:
            h = dispatched[call.pick % len(dispatched)].handle
            x, weights = _payload(rng, h.num_tokens, call)
            out = buf.dispatch(x, handle=h, topk_weights=weights, cpu_sync=call.cpu_sync, return_recv_hook=call.hook)
        elif call.op == "combine" and dispatched:
            earlier = dispatched[call.pick % len(dispatched)]
            weights = None if earlier.recv_topk_weights is None else in_layout(earlier.recv_topk_weights, call.w_layout)
            outputs.append(_received(buf.combine(in_layout(earlier.recv_x, call.x_layout), earlier.handle,
                                                 topk_weights=weights, bias=_bias(rng, earlier.handle.num_tokens, call.bias),
                                                 return_recv_hook=call.hook)))
        if out is not None:
            out = _received(out)
            dispatched.append(out)
            outputs.append(out)
    return outputs


@pytest.mark.parametrize("use_puts", [False, True], ids=["stores", "puts"])
@given(sequence=st.lists(calls, min_size=2, max_size=12))
def test_a_random_sequence_of_calls_on_one_buffer_gives_the_mpi_backends_bytes(use_puts, sequence):
    with _mpi_buffer() as reference, simulated_buffer(use_puts=use_puts) as simulated:
        assert_same_outputs(run_sequence(reference, sequence), run_sequence(simulated, sequence))
