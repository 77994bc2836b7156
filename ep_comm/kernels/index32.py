"""Index division in 32-bit unsigned arithmetic (``div.u32``/``rem.u32``), for non-negative indices below 2**31.

Numba types integer arithmetic at 64 bits, and a 64-bit division by a run-time value compiles to
some 70 SASS instructions (32-bit unsigned: about 20). Kernel indices (tokens, entries, rows, ranks,
experts, words) stay far below 2**31 (the host checks the products that bound them), so their
quotients and remainders are exact in unsigned 32-bit arithmetic. The results are zero-extended to
int64, Numba's index type: the compiler then knows them non-negative and drops the negative-index
wraparound of the array accesses they feed. The Python bodies are what the CUDA simulator runs;
compiled kernels use the intrinsic below.

Grid- and block-stride loops are ``while`` loops over an int32 index (``i = np.int32(i + step)``): a
``range`` with a run-time step divides to get its trip count, and so does LLVM's loop unroller for a
64-bit index. The host keeps every index and its last stride below 2**31 (``Kernels``' size check).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.core.errors import TypingError
from numba.cuda.extending import intrinsic, overload

LIMIT = 1 << 31


def _check_operands(a, b) -> None:
    """The simulator's guard of the compiled division's domain: outside it the unsigned 32-bit quotient is not
    Python's floor division, so a kernel that divides a negative or too large value fails its simulator tests."""
    if not (0 <= a < LIMIT and 0 < b < LIMIT):
        raise ValueError(f"32-bit index division of a={a} by b={b}: needs 0 <= a < 2**31 and 0 < b < 2**31")


def divmod32(a, b):
    """``(a // b, a % b)`` of an index ``0 <= a < 2**31`` and ``0 < b < 2**31``."""
    _check_operands(a, b)
    return a // b, a % b


def quotient32(a, b):
    """``a // b`` of an index ``0 <= a < 2**31`` and ``0 < b < 2**31``."""
    _check_operands(a, b)
    return a // b


@intrinsic
def _udivrem32(typingctx, a, b):
    if not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
        raise TypingError(f"32-bit index division needs integers, got {a} and {b}")
    sig = types.UniTuple(types.int64, 2)(a, b)

    def codegen(context, builder, sig, args):
        x, y = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args))
        wide = ir.IntType(64)
        values = [builder.zext(builder.udiv(x, y), wide), builder.zext(builder.urem(x, y), wide)]
        return context.make_tuple(builder, sig.return_type, values)

    return sig, codegen


@overload(divmod32, target="cuda")
def _divmod32_cuda(a, b):
    return lambda a, b: _udivrem32(a, b)


@overload(quotient32, target="cuda")
def _quotient32_cuda(a, b):
    return lambda a, b: _udivrem32(a, b)[0]
