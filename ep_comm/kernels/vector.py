"""Two adjacent array elements in one vector load or store (``ld.v2`` / ``st.v2``, generic addressing).

Numba issues one scalar access per element; a lane that moves 16 bytes per instruction halves the
instructions of a row copy and keeps twice the bytes in flight. The caller guarantees that element
``i`` is aligned to twice the element size. The Python bodies are what the CUDA simulator runs;
compiled kernels use the inline PTX below.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.core.errors import TypingError
from numba.cuda.extending import intrinsic, overload

REGISTER = {16: "h", 32: "r", 64: "l"}  # PTX inline-asm operand constraint per element width


def load_pair(array, i):
    """``(array[i], array[i + 1])`` of a 1-D array, in one load."""
    return array[i], array[i + 1]


def store_pair(array, i, first, second):
    """``array[i], array[i + 1] = first, second`` in one store."""
    array[i] = first
    array[i + 1] = second


def _element_width(array) -> int:
    """Bit width of a 1-D integer array's elements; a typing error for anything else."""
    if not isinstance(array, types.Array) or array.ndim != 1 or not isinstance(array.dtype, types.Integer) \
            or array.dtype.bitwidth not in REGISTER:
        raise TypingError(f"vector access needs a 1-D array of 16/32/64-bit integers, got {array}")
    return array.dtype.bitwidth


def _element_pointer(context, builder, array_type, array, index):
    """LLVM pointer to ``array[index]`` (no bounds or wraparound handling)."""
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index], wraparound=False)


@intrinsic
def _load_pair(typingctx, array, index):
    bits = _element_width(array)

    def codegen(context, builder, sig, args):
        element = ir.IntType(bits)
        asm_type = ir.FunctionType(ir.LiteralStructType([element, element]), [element.as_pointer()])
        load = ir.InlineAsm(asm_type, f"ld.v2.b{bits} {{$0, $1}}, [$2];", f"={REGISTER[bits]},={REGISTER[bits]},l",
                            side_effect=True)
        pair = builder.call(load, [_element_pointer(context, builder, sig.args[0], args[0], args[1])])
        values = [builder.extract_value(pair, 0), builder.extract_value(pair, 1)]
        return context.make_tuple(builder, sig.return_type, values)

    return types.UniTuple(array.dtype, 2)(array, index), codegen


@intrinsic
def _store_pair(typingctx, array, index, first, second):
    bits = _element_width(array)

    def codegen(context, builder, sig, args):
        element = ir.IntType(bits)
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        values = [context.cast(builder, v, t, sig.args[0].dtype) for v, t in zip(args[2:], sig.args[2:])]
        asm_type = ir.FunctionType(ir.VoidType(), [element.as_pointer(), element, element])
        store = ir.InlineAsm(asm_type, f"st.v2.b{bits} [$0], {{$1, $2}};",
                             f"l,{REGISTER[bits]},{REGISTER[bits]},~{{memory}}", side_effect=True)
        builder.call(store, [pointer, *values])

    return types.void(array, index, first, second), codegen


@overload(load_pair, target="cuda")
def _load_pair_cuda(array, i):
    return lambda array, i: _load_pair(array, i)


@overload(store_pair, target="cuda")
def _store_pair_cuda(array, i, first, second):
    return lambda array, i, first, second: _store_pair(array, i, first, second)
