"""Sequences of eager calls on one Buffer, drawn by Hypothesis: new routings, replays of earlier handles and combines
of earlier outputs, of a few token counts (so that call shapes recur), each input in a memory layout of its own, a
bias of one array, of two, or of one array twice, weights that are a view of the payload's bytes, receive hooks.

The defects of recorded calls seen so far (a call replaying the launches of another layout of its ids; a bias pair of
one array recorded for later pairs of two) each needed a particular order of calls of one shape: a sequence drawn
here is run on the Buffer under test and on a reference (another backend, or with ``apart=True``: every input
C-contiguous and no two inputs sharing bytes), and every output must have the same bytes
(``helpers.same_outputs.assert_same_outputs``). Inputs come from each call's seed and the rank: every rank draws the
same calls and makes its own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np
from hypothesis import strategies as st

import ep_comm
from helpers.layouts import in_layout

LAYOUTS = ("C", "F", "offset", "rows", "columns")
BIASES = ("none", "one", "pair", "same twice")


@dataclass(frozen=True)
class Call:
    """One drawn call: ``op`` new / cached / combine; ``tokens`` of a new routing (at most the Buffer's); ``pick`` the
    earlier handle (cached) or output (combine) it takes, modulo their count; a new routing's mode,
    ``expert_alignment``, ``zero_padding`` and ids' dtype; ``hook``: sent with ``return_recv_hook=True`` and received
    by calling the hook at once; the layouts of its inputs; ``weights`` none, given, or ``"view"``: a view of the
    payload's own bytes (a float32 payload); ``bias`` of a combine."""

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
                  cpu_sync=st.booleans(), hook=st.booleans(), weights=st.sampled_from(("none", "given", "view")),
                  bias=st.sampled_from(BIASES), x_layout=st.sampled_from(LAYOUTS), idx_layout=st.sampled_from(LAYOUTS),
                  w_layout=st.sampled_from(LAYOUTS))
sequences = st.lists(calls, min_size=2, max_size=12)


class _Inputs:
    """A call's inputs for one Buffer: host arrays from the call's seed and ``rank``, put on the Buffer's device by
    ``device``, in the call's layouts (``apart``: C-contiguous, none sharing bytes with another)."""

    def __init__(self, buf: ep_comm.Buffer, call: Call, rank: int, device: Callable[[Any], Any], apart: bool):
        self.geo, self.call, self.device, self.apart = buf.geometry, call, device, apart
        self.rng = np.random.default_rng((call.seed, rank))

    def layout(self, a: Optional[Any], layout: str) -> Optional[Any]:
        """Device array ``a`` in ``layout`` (C-contiguous where ``apart``)."""
        return in_layout(a, "C" if self.apart else layout)

    def routing(self, tokens: int) -> Any:
        """``[tokens, K]`` ids of the call's dtype and layout: distinct experts per token, some entries -1."""
        geo = self.geo
        ids = np.full((tokens, geo.num_topk), -1, np.int64)
        for row in ids:
            row[:] = self.rng.permutation(geo.num_experts)[:geo.num_topk]
        ids[self.rng.random(ids.shape) < 0.3] = -1
        return self.layout(self.device(ids.astype(self.call.ids)), self.call.idx_layout)

    def payload(self, tokens: int) -> tuple:
        """``(x [T, H], weights [T, K] float32 or None)``; ``"view"`` weights are the first ``T * K`` values of a
        C-contiguous float32 ``x``'s own bytes (copied where ``apart``)."""
        geo, call = self.geo, self.call
        x = self.device(self.rng.standard_normal((tokens, geo.hidden)).astype(geo.dtype))
        if call.weights == "view" and geo.dtype == np.float32:
            weights = x.reshape(-1)[:tokens * geo.num_topk].reshape(tokens, geo.num_topk)
            return x, weights.copy() if self.apart else weights
        if call.weights == "none":
            return self.layout(x, call.x_layout), None
        weights = self.device(self.rng.random((tokens, geo.num_topk)).astype(np.float32))
        return self.layout(x, call.x_layout), self.layout(weights, call.w_layout)

    def bias(self, tokens: int) -> Any:
        """A combine's ``bias``: None, one ``[T, H]`` float32 array, a pair of two, or one array twice (two copies
        where ``apart``)."""
        one = self.device(self.rng.standard_normal((tokens, self.geo.hidden)).astype(np.float32))
        kind = self.call.bias
        if kind == "same twice":
            return (one, one.copy()) if self.apart else (one, one)
        return {"none": None, "one": one, "pair": (one, one * np.float32(3) + np.float32(1))}[kind]


def _received(out: Any) -> Any:
    """A call's output: ``out``, or what its receive hook returns."""
    return out() if isinstance(out, ep_comm.RecvHook) else out


def run_sequence(buf: ep_comm.Buffer, sequence: List[Call], rank: int = 0, device: Callable[[Any], Any] = np.asarray,
                 apart: bool = False) -> list:
    """Make ``sequence``'s calls on ``buf`` (collective: every rank the same sequence), this rank's inputs on the
    device by ``device``; every output, in call order (a call with no earlier handle or output to take is skipped, the
    same on every rank and backend)."""
    dispatched: List[Any] = []
    outputs: list = []
    for call in sequence:
        inputs = _Inputs(buf, call, rank, device, apart)
        hook = call.hook
        if call.op == "new":
            x, weights = inputs.payload(min(call.tokens, buf.geometry.max_tokens))
            out = buf.dispatch(x, inputs.routing(x.shape[0]), weights, expand=call.expand,
                               expert_alignment=call.alignment, zero_padding=call.zero_padding, cpu_sync=call.cpu_sync,
                               return_recv_hook=hook)
        elif call.op == "cached" and dispatched:
            h = dispatched[call.pick % len(dispatched)].handle
            x, weights = inputs.payload(h.num_tokens)
            out = buf.dispatch(x, handle=h, topk_weights=weights, cpu_sync=call.cpu_sync, return_recv_hook=hook)
        elif call.op == "combine" and dispatched:
            earlier = dispatched[call.pick % len(dispatched)]
            weights = inputs.layout(earlier.recv_topk_weights, call.w_layout)
            outputs.append(_received(buf.combine(inputs.layout(earlier.recv_x, call.x_layout), earlier.handle,
                                                 topk_weights=weights, bias=inputs.bias(earlier.handle.num_tokens),
                                                 return_recv_hook=hook)))
            continue
        else:
            continue
        dispatched.append(_received(out))
        outputs.append(dispatched[-1])
    return outputs
