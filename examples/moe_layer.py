"""A Mixture-of-Experts layer on ep_comm's expand dispatch, checked against a dense reference.

    mpirun -np 4 python -m examples.moe_layer                        # CPU: mpi backend, NumPy arrays
    launch/mpirun_gpu.sh 2 examples.moe_layer --dtype bfloat16        # GPUs: nvshmem backend, CuPy arrays

Every rank holds ``T`` tokens ``x [T, H]`` (payload dtype) and the weights of its ``E/R`` local experts:

1. router: ``logits = x @ W_gate [H, E]`` in float32, softmax, the top-k distinct experts, their
   probabilities renormalised to sum to 1 per token;
2. ``buf.dispatch(x, topk_idx, topk_weights, expand=True, expert_alignment=A)``: one row per
   (token, local expert), expert-major, each local expert's block starting at a multiple of A;
3. each local expert's MLP ``silu(rows @ W1 [H, F]) @ W2 [F, H]`` on its block, in float32, cast back
   to the payload dtype (padding rows stay zero);
4. ``buf.combine(y, handle, topk_weights=out.recv_topk_weights)``: ``out[t] = sum_k w_k expert_{e_k}(x[t])``.

The layer is written once against :class:`ArrayOps`, the few array operations it needs, over NumPy
or CuPy here and over PyTorch in ``examples.torch_moe_layer``. ``main`` checks the distributed
result against a dense single-process NumPy reference of the same layer (every rank knows all
experts' weights from a shared seed) and exits 1 when an error exceeds its bound.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

import ep_comm
from ep_comm.cli import ArgumentParser, environment_problem, exit_collectively, int_at_least, usage_exit
from ep_comm.contract.choices import BACKENDS
from ep_comm.contract.layout import expert_starts
from ep_comm.testing.dtypes import DTYPE_NAMES, RELATIVE_ERROR_BOUND

Array = Any  # numpy.ndarray, cupy.ndarray or torch.Tensor, as the ArrayOps in use makes them

# The relative error ||out - reference|| / ||reference|| over all ranks' tokens is held to the dtype's
# RELATIVE_ERROR_BOUND: the payload's rounding of x, of the expert outputs and of the combined result.
# Bound on the router's distance from the reference top-k (float32 vs float64 softmax probabilities).
ROUTER_ERROR_BOUND = 1e-5


class ArrayOps:
    """The array operations of the layer, over NumPy (mpi backend) or CuPy (nvshmem backend).

    ``xp`` is the array module; ``dtype`` the payload dtype (a NumPy dtype, bfloat16 from ml_dtypes).
    Activations and weights are float32 arrays, expert ids int64. Subclasses adapt other libraries.
    """

    def __init__(self, xp: Any, dtype: Any):
        self.xp = xp
        self.dtype = np.dtype(dtype)

    def exp(self, a: Array) -> Array:
        return self.xp.exp(a)

    def zeros_like(self, a: Array) -> Array:
        return self.xp.zeros_like(a)

    def row_max(self, a: Array) -> Array:
        """``[T, n] -> [T, 1]``."""
        return a.max(axis=-1, keepdims=True)

    def row_sum(self, a: Array) -> Array:
        """``[T, n] -> [T, 1]``."""
        return a.sum(axis=-1, keepdims=True)

    def topk(self, a: Array, k: int) -> Tuple[Array, Array]:
        """The ``k`` largest entries of each row of ``a [T, n]``, largest first: ``(values [T, k], indices
        [T, k] int64)``."""
        idx = self.xp.argsort(-a, axis=-1)[:, :k].astype(self.xp.int64)
        return self.xp.take_along_axis(a, idx, axis=-1), idx

    def float32(self, a: Array) -> Array:
        """Payload ``a`` as float32 (bfloat16 widened through its bits: exact, the same on NumPy and CuPy)."""
        xp = self.xp
        if self.dtype.name == "bfloat16":
            return (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
        return a.astype(xp.float32)

    def to_payload(self, a: Array) -> Array:
        """float32 ``a`` in the payload dtype; bfloat16 rounds to nearest even through the bits (NaN ->
        quiet NaN), as ml_dtypes does, with integer arithmetic that NumPy and CuPy both have."""
        xp = self.xp
        if self.dtype.name != "bfloat16":
            return a.astype(self.dtype)
        bits = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
        nearest_even = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x0040
        return xp.where(xp.isnan(a), quiet_nan, nearest_even).astype(xp.uint16).view(self.dtype)

    def asarray(self, host: np.ndarray) -> Array:
        """A host NumPy array on the layer's device."""
        return self.xp.asarray(host)

    def to_host(self, a: Array) -> np.ndarray:
        """A NumPy copy of float32 or integer ``a``."""
        return a if self.xp is np else self.xp.asnumpy(a)

    def to_buffer(self, a: Array) -> Array:
        """``a`` as the Buffer takes it (NumPy and CuPy arrays go in as they are)."""
        return a

    def from_buffer(self, a: Array) -> Array:
        """A Buffer output (NumPy or CuPy) as this library's array."""
        return a


def softmax(ops: ArrayOps, logits: Array) -> Array:
    """Row softmax of ``logits [T, E]``."""
    e = ops.exp(logits - ops.row_max(logits))
    return e / ops.row_sum(e)


def route(ops: ArrayOps, x: Array, w_gate: Array, num_topk: int) -> Tuple[Array, Array]:
    """Top-k routing of ``x [T, H]`` (payload dtype) by ``w_gate [H, E]`` float32.

    Returns ``topk_idx [T, K]`` int64 (K distinct experts, most probable first) and ``topk_weights
    [T, K]`` float32 (their softmax probabilities renormalised to sum to 1 per token).
    """
    top, idx = ops.topk(softmax(ops, ops.float32(x) @ w_gate), num_topk)
    return idx, top / ops.row_sum(top)


def expert_mlp(ops: ArrayOps, rows: Array, w1: Array, w2: Array) -> Array:
    """One expert: ``silu(rows [n, H] @ w1 [H, F]) @ w2 [F, H]`` in the dtype of the operands (float32)."""
    h = rows @ w1
    return (h / (1 + ops.exp(-h))) @ w2


def expert_segments(handle: ep_comm.EPHandle) -> List[Tuple[int, int]]:
    """``(start, count)`` of each local expert's rows in an expand dispatch's ``recv_x``:
    ``start_e = align(psum[e-1], A)``, ``count_e = psum[e] - start_e`` (needs ``cpu_sync=True``)."""
    ends = np.asarray(handle.psum_num_recv_tokens_per_expert.tolist(), dtype=np.int64)
    starts = expert_starts(ends, handle.expert_alignment)
    return [(int(start), int(end - start)) for start, end in zip(starts, ends)]


@dataclass(frozen=True)
class MoEParams:
    """Host float32 weights of the whole layer: ``w_gate [H, E]``, ``w1 [E, H, F]``, ``w2 [E, F, H]``."""

    w_gate: np.ndarray
    w1: np.ndarray
    w2: np.ndarray


def make_params(hidden: int, ffn: int, num_experts: int, seed: int) -> MoEParams:
    """Weights from ``seed`` (the same on every rank), scaled by ``1/sqrt(fan_in)`` so activations stay O(1)."""
    rng = np.random.default_rng(seed)

    def normal(shape: Tuple[int, ...], fan_in: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))

    return MoEParams(normal((hidden, num_experts), hidden), normal((num_experts, hidden, ffn), hidden),
                     normal((num_experts, ffn, hidden), ffn))


class LayerOutput(NamedTuple):
    y: Array  # [T, H] payload dtype: the layer's output
    topk_idx: Array  # [T, K] int64: the router's experts
    topk_weights: Array  # [T, K] float32: their weights


class MoELayer:
    """A top-k MoE layer whose experts live on the ranks of ``buf``: rank ``r`` computes experts
    ``[r*E/R, (r+1)*E/R)``; only those weights (and the gate) are copied onto its device."""

    def __init__(self, buf: ep_comm.Buffer, params: MoEParams, ops: ArrayOps, expert_alignment: int = 1):
        geo = buf.geometry
        want = {"w_gate": (geo.hidden, geo.num_experts), "w1": (geo.num_experts, geo.hidden, None),
                "w2": (geo.num_experts, None, geo.hidden)}
        for name, shape in want.items():
            got = getattr(params, name).shape
            if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
                raise ValueError(f"params.{name} has shape {got}: must be {list(shape)} (None: any) for this Buffer")
        lo, hi = buf.rank * buf.num_local_experts, (buf.rank + 1) * buf.num_local_experts
        self.buf, self.ops, self.expert_alignment = buf, ops, expert_alignment
        self.w_gate = ops.asarray(params.w_gate)
        self.w1 = [ops.asarray(w) for w in params.w1[lo:hi]]
        self.w2 = [ops.asarray(w) for w in params.w2[lo:hi]]

    def on(self, buf: ep_comm.Buffer) -> "MoELayer":
        """This layer on another Buffer of the same geometry and rank (another micro-batch's), sharing the
        device weights."""
        if buf.geometry != self.buf.geometry or buf.rank != self.buf.rank:
            raise ValueError(f"buf: geometry {buf.geometry} at rank {buf.rank}: must be this layer's "
                             f"({self.buf.geometry} at rank {self.buf.rank}) to share its weights")
        other = copy.copy(self)
        other.buf = buf
        return other

    def forward(self, x: Array) -> LayerOutput:
        """The layer on this rank's tokens ``x [T, H]`` (payload dtype); collective over the Buffer's ranks."""
        topk_idx, topk_weights = self.route(x)
        out = self.dispatch(x, topk_idx, topk_weights)
        return self.output(self.combine(self.compute(out), out), topk_idx, topk_weights)

    def route(self, x: Array) -> Tuple[Array, Array]:
        """``(topk_idx [T, K] int64, topk_weights [T, K] float32)`` of ``x [T, H]``: :func:`route` by the gate."""
        return route(self.ops, x, self.w_gate, self.buf.geometry.num_topk)

    def dispatch(self, x: Array, topk_idx: Array, topk_weights: Array, return_recv_hook: bool = False
                 ) -> Union[ep_comm.DispatchOutput, ep_comm.RecvHook]:
        """Expand dispatch of ``x [T, H]`` with its routing: the ``DispatchOutput``, or with ``return_recv_hook``
        the ``RecvHook`` that returns it (only the send half is enqueued)."""
        ops = self.ops
        return self.buf.dispatch(ops.to_buffer(x), ops.to_buffer(topk_idx), ops.to_buffer(topk_weights), expand=True,
                                 expert_alignment=self.expert_alignment, return_recv_hook=return_recv_hook)

    def compute(self, out: ep_comm.DispatchOutput) -> Array:
        """The local experts on a dispatch's ``recv_x [M, H]``: ``y [M, H]`` payload dtype, as the Buffer takes it."""
        ops = self.ops
        return ops.to_buffer(self.experts(ops.from_buffer(out.recv_x), expert_segments(out.handle)))

    def combine(self, y: Array, out: ep_comm.DispatchOutput, return_recv_hook: bool = False
                ) -> Union[ep_comm.CombineOutput, ep_comm.RecvHook]:
        """Combine of the expert outputs ``y [M, H]`` of dispatch ``out``, weighted by its ``recv_topk_weights``:
        the ``CombineOutput``, or with ``return_recv_hook`` the ``RecvHook`` that returns it."""
        return self.buf.combine(y, out.handle, topk_weights=out.recv_topk_weights, return_recv_hook=return_recv_hook)

    def output(self, res: ep_comm.CombineOutput, topk_idx: Array, topk_weights: Array) -> LayerOutput:
        """The layer's output from a combine's ``x [T, H]`` and the routing ``[T, K]``."""
        return LayerOutput(self.ops.from_buffer(res.x), topk_idx, topk_weights)

    def experts(self, recv_x: Array, segments: Sequence[Tuple[int, int]]) -> Array:
        """Local experts on their blocks ``(start, count)`` of ``recv_x [M, H]``; ``[M, H]`` payload dtype."""
        ops = self.ops
        x32 = ops.float32(recv_x)
        y32 = ops.zeros_like(x32)
        for (start, count), w1, w2 in zip(segments, self.w1, self.w2):
            if count:
                y32[start:start + count] = expert_mlp(ops, x32[start:start + count], w1, w2)
        return ops.to_payload(y32)


# ------------------------------------------------------------------------------------- reference
HOST = ArrayOps(np, np.float32)  # the reference's operations: NumPy, float32 "payload"


def reference_forward(x32: np.ndarray, params: MoEParams, topk_idx: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """Dense single-process layer: ``sum_k w_k expert_{e_k}(x)`` for each token of ``x32 [T, H]`` float32,
    with the routing ``topk_idx [T, K]`` / ``topk_weights [T, K]``; ``[T, H]`` float64."""
    out = np.zeros(x32.shape, np.float64)
    for e in range(params.w1.shape[0]):
        tokens, slots = np.nonzero(topk_idx == e)
        if tokens.size:
            y = expert_mlp(HOST, x32[tokens], params.w1[e], params.w2[e])
            out[tokens] += topk_weights[tokens, slots, None].astype(np.float64) * y  # a token picks e at most once
    return out


def router_error(x32: np.ndarray, w_gate: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray) -> float:
    """How far a routing ``topk_idx``/``topk_weights [T, K]`` of ``x32 [T, H]`` is from a top-k of the
    float64 router: the larger of |weight - renormalised probability| and of how far a chosen expert's
    probability lies below the K-th largest (a near tie may go either way)."""
    if not topk_idx.size:
        return 0.0
    k = topk_idx.shape[1]
    probs = softmax(HOST, x32.astype(np.float64) @ w_gate.astype(np.float64))
    chosen = np.take_along_axis(probs, topk_idx, axis=1)
    kth_largest = -np.partition(-probs, k - 1, axis=1)[:, k - 1:k]
    weight_error = np.abs(chosen / chosen.sum(axis=1, keepdims=True) - topk_weights).max()
    return float(max(weight_error, (kth_largest - chosen).max()))


@dataclass(frozen=True)
class CheckResult:
    relative_error: float  # ||out - reference|| / ||reference|| over all ranks' tokens
    router_error: float  # the largest router_error of any rank
    bound: float  # RELATIVE_ERROR_BOUND of the dtype

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.bound and self.router_error <= ROUTER_ERROR_BOUND


def check_layer(comm: MPI.Comm, ops: ArrayOps, params: MoEParams, x: Array, result: LayerOutput) -> CheckResult:
    """Compare every rank's layer output with the reference (collective over ``comm``)."""
    x32 = ops.to_host(ops.float32(x))
    idx, weights = ops.to_host(result.topk_idx), ops.to_host(result.topk_weights)
    ref = reference_forward(x32, params, idx, weights)
    diff = ops.to_host(ops.float32(result.y)).astype(np.float64) - ref
    sq_err, sq_ref = comm.allreduce(np.array([np.sum(diff * diff), np.sum(ref * ref)]), op=MPI.SUM)
    rel = float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else float(np.sqrt(sq_err))
    return CheckResult(rel, comm.allreduce(router_error(x32, params.w_gate, idx, weights), op=MPI.MAX),
                       RELATIVE_ERROR_BOUND[ops.dtype.name])


# ------------------------------------------------------------------------------------- command line
def parser(prog: str) -> argparse.ArgumentParser:
    """Options shared by the NumPy/CuPy and the PyTorch examples."""
    p = ArgumentParser(prog=prog, description="MoE layer on ep_comm (gate, expand dispatch, expert "
                                "MLPs, combine) checked against a dense reference. Run under mpirun, one "
                                "process per rank (GPU). Exit status: 0 ok, 1 check failed, 2 bad options or no "
                                "GPU stack for --backend nvshmem.")
    p.add_argument("--tokens", type=int_at_least(0), default=256, help="tokens per rank (default: 256)")
    p.add_argument("--hidden", type=int_at_least(1), default=256, help="hidden size H (default: 256)")
    p.add_argument("--ffn", type=int_at_least(1), default=512, help="expert MLP width F (default: 512)")
    p.add_argument("--experts", type=int_at_least(1), default=16,
                   help="experts E, divisible by the number of ranks (default: 16)")
    p.add_argument("--topk", type=int_at_least(1), default=4, help="experts per token K (default: 4)")
    p.add_argument("--alignment", type=int_at_least(1), default=8,
                   help="expert_alignment: rows per expert block rounded up to it (default: 8)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="payload dtype (default: bfloat16)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="ep_comm backend: auto = nvshmem where a GPU stack is found, else mpi (default: auto)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of weights and tokens (default: 0)")
    return p


def parse_args(prog: str, argv: Optional[Sequence[str]], num_ranks: int,
               p: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse with ``p`` (default: :func:`parser`) and cross-check the options (exits 2 naming the option,
    its value and the rule)."""
    p = parser(prog) if p is None else p
    args = p.parse_args(argv)
    if args.topk > args.experts:
        p.error(f"--topk={args.topk}: must be <= --experts={args.experts} (distinct experts per token)")
    if args.experts % num_ranks:
        p.error(f"--experts={args.experts}: must be divisible by the number of ranks ({num_ranks})")
    return args


def open_buffer(comm: MPI.Comm, args: argparse.Namespace, num_max_tokens: int) -> ep_comm.Buffer:
    """The Buffer of the options' geometry, dtype and backend for up to ``num_max_tokens`` tokens per rank
    (at least 1); collective over ``comm``."""
    return ep_comm.Buffer(comm, num_experts=args.experts, hidden=args.hidden, num_topk=args.topk,
                          num_max_tokens_per_rank=max(num_max_tokens, 1), dtype=args.dtype, backend=args.backend)


def seeded_tokens(args: argparse.Namespace, ops: ArrayOps, rank: int) -> Array:
    """Rank ``rank``'s ``x [--tokens, --hidden]`` in the payload dtype, standard normal from ``--seed``."""
    rng = np.random.default_rng((args.seed, 1, rank))
    return ops.to_payload(ops.asarray(rng.standard_normal((args.tokens, args.hidden), np.float32)))


def check_line(name: str, comm: MPI.Comm, backend: str, args: argparse.Namespace, check: CheckResult) -> str:
    """The one line rank 0 prints: OK/FAILED, the run's shape and the errors against their bounds."""
    return (f"{name}: {'OK' if check.ok else 'FAILED'} ranks={comm.size} backend={backend} dtype={args.dtype} "
            f"T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} K={args.topk} A={args.alignment}: "
            f"relative error {check.relative_error:.2e} (bound {check.bound:.0e}), router error "
            f"{check.router_error:.1e} (bound {ROUTER_ERROR_BOUND:.0e})")


def run(args: argparse.Namespace, make_ops: Callable[[ep_comm.Buffer], ArrayOps], name: str,
        comm: Optional[MPI.Comm] = None) -> int:
    """Build the layer on ``comm`` (default: COMM_WORLD), run it on seeded tokens, check it; rank 0
    prints one line. Returns the exit status: 0 ok, 1 the check failed, 2 the environment cannot run
    ``--backend`` (one line, by rank 0) (the same on every rank)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    code = usage_exit(name, comm, environment_problem(comm, args.backend))
    if code is not None:
        return code
    params = make_params(args.hidden, args.ffn, args.experts, args.seed)
    with open_buffer(comm, args, args.tokens) as buf:
        ops = make_ops(buf)
        layer = MoELayer(buf, params, ops, args.alignment)
        x = seeded_tokens(args, ops, comm.rank)
        check = check_layer(comm, ops, params, x, layer.forward(x))
        backend = buf.backend
    if comm.rank == 0:
        print(check_line(name, comm, backend, args, check), flush=True)
    return 0 if check.ok else 1


def array_ops(buf: ep_comm.Buffer) -> ArrayOps:
    """NumPy operations for the mpi backend, CuPy for nvshmem."""
    if buf.backend == "nvshmem":
        import cupy

        return ArrayOps(cupy, buf.geometry.dtype)
    return ArrayOps(np, buf.geometry.dtype)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args("python -m examples.moe_layer", argv, MPI.COMM_WORLD.size)
    return run(args, array_ops, "moe_layer")


if __name__ == "__main__":
    exit_collectively(main)
