"""Combine arithmetic on the GPU in the exact float32 order of ``ep_comm.reduce``.

Two CUDA C kernels (CuPy ``RawModule``) templated on the payload type:

* ``expand_partials``: ``acc = 0.0f; acc = acc + w * y[row_k]`` over the top-k entries in order
  (``__fmul_rn``/``__fadd_rn``: the compiler may not fuse them into an FMA), rounded once;
* ``combine_reduce``: ``acc = 0.0f``, plus each bias term, plus the row of every rank the token
  reached in ascending rank order, rounded once to the payload dtype.

bfloat16 is rounded to nearest even with NaN -> 0x7FC0/0xFFC0, as ml_dtypes does; float16 uses
``cvt.rn.f16.f32`` (NaN payloads may differ from NumPy's; finite values are identical).
"""
from __future__ import annotations

import functools

import numpy as np

_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

_SOURCE = r"""
typedef long long i64;

__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 31) ? 0xffc0 : 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

template <int DT> __device__ __forceinline__ float load_f(const void* p, i64 i) {
    if (DT == 0) return ((const float*)p)[i];
    if (DT == 1) return h2f(((const unsigned short*)p)[i]);
    return bf2f(((const unsigned short*)p)[i]);
}
template <int DT> __device__ __forceinline__ void store_f(void* p, i64 i, float v) {
    if (DT == 0) ((float*)p)[i] = v;
    else if (DT == 1) ((unsigned short*)p)[i] = f2h(v);
    else ((unsigned short*)p)[i] = f2bf(v);
}

// out[i, h] = sum over k in order of w[e] * y[e, h], e = expanded_row[i, k] >= 0 (w = 1 when weights is NULL)
template <int DT>
__global__ void expand_partials(const void* y, const int* expanded_row, const float* weights,
                                i64 num_rows, int num_topk, i64 hidden, void* out) {
    const i64 total = num_rows * hidden;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = j / hidden, h = j % hidden;
        float acc = 0.0f;
        for (int k = 0; k < num_topk; ++k) {
            const i64 e = expanded_row[i * num_topk + k];
            if (e < 0) continue;
            float term = load_f<DT>(y, e * hidden + h);
            if (weights) term = __fmul_rn(weights[e], term);
            acc = __fadd_rn(acc, term);
        }
        store_f<DT>(out, j, acc);
    }
}

// out[t, h] = bias terms + rows[r][slots[t, r]][h] for r ascending where slots[t, r] >= 0
template <int DT>
__global__ void combine_reduce(const unsigned char* rows, i64 row_bytes, i64 max_tokens, const i64* slots,
                               int num_ranks, const float* bias, int num_bias, i64 num_tokens, i64 hidden,
                               void* out) {
    const i64 total = num_tokens * hidden;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.x * blockDim.x) {
        const i64 t = j / hidden, h = j % hidden;
        float acc = 0.0f;
        for (int b = 0; b < num_bias; ++b) acc = __fadd_rn(acc, bias[b * total + j]);
        for (int r = 0; r < num_ranks; ++r) {
            const i64 s = slots[t * num_ranks + r];
            if (s >= 0) acc = __fadd_rn(acc, load_f<DT>(rows + (r * max_tokens + s) * row_bytes, h));
        }
        store_f<DT>(out, j, acc);
    }
}

extern "C" __global__ void bf16_to_f32(const unsigned short* src, i64 n, float* out) {
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < n; j += (i64)gridDim.x * blockDim.x)
        out[j] = bf2f(src[j]);
}
"""

THREADS = 256


def dtype_code(dtype: np.dtype) -> int:
    """0/1/2 for float32/float16/bfloat16 payloads."""
    name = np.dtype(dtype).name
    if name not in _DTYPE_CODES:
        raise TypeError(f"payload dtype {name} is not one of {sorted(_DTYPE_CODES)}")
    return _DTYPE_CODES[name]


@functools.lru_cache(maxsize=None)
def _module(device: int):
    import cupy

    names = [f"{k}<{c}>" for k in ("expand_partials", "combine_reduce") for c in _DTYPE_CODES.values()]
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=_SOURCE, options=("--std=c++14",), name_expressions=names)


def _kernel(name: str):
    import cupy

    return _module(cupy.cuda.Device().id).get_function(name)


def _grid(total: int) -> int:
    return max(1, min(-(-total // THREADS), 65535 * 4))


def _null(arr):
    return np.uint64(0) if arr is None else arr


def _raw(arr):
    """The same device memory as uint8 (kernels take payloads as untyped pointers)."""
    import cupy

    return arr.view(cupy.uint8)


def expand_partials(y, expanded_row, weights, out) -> None:
    """``out [N, H]`` (payload) from ``y [M, H]`` (payload, C-contiguous), ``expanded_row [N, K]``
    int32 and ``weights [M]`` float32 or None."""
    num_rows, num_topk = expanded_row.shape
    total = num_rows * out.shape[1]
    if total == 0:
        return
    _kernel(f"expand_partials<{dtype_code(out.dtype)}>")(
        (_grid(total),), (THREADS,),
        (_raw(y), expanded_row, _null(weights), np.int64(num_rows), np.int32(num_topk), np.int64(out.shape[1]),
         _raw(out)))


def combine_reduce(rows_region, row_bytes: int, max_tokens: int, slots, bias, out) -> None:
    """``out [T, H]`` (payload) = bias terms (float32 ``[nb, T, H]`` or None) + the row each rank
    ``r`` sent back for token ``t`` at ``slots[t, r]`` (int64 ``[T, R]``, -1: not reached) in
    ``rows_region`` (uint8 view of ``[R][max_tokens][row_bytes]``)."""
    num_tokens, hidden = out.shape
    total = num_tokens * hidden
    if total == 0:
        return
    _kernel(f"combine_reduce<{dtype_code(out.dtype)}>")(
        (_grid(total),), (THREADS,),
        (rows_region, np.int64(row_bytes), np.int64(max_tokens), slots, np.int32(slots.shape[1]), _null(bias),
         np.int32(0 if bias is None else bias.shape[0]), np.int64(num_tokens), np.int64(hidden), _raw(out)))


def to_float32(arr):
    """A float32 copy of a floating device array (bfloat16 widened exactly, others by ``astype``)."""
    import cupy

    if np.dtype(arr.dtype).name != "bfloat16":
        return cupy.ascontiguousarray(arr).astype(cupy.float32)
    src = cupy.ascontiguousarray(arr).view(cupy.uint16)
    out = cupy.empty(src.shape, dtype=cupy.float32)
    if src.size:
        _kernel("bf16_to_f32")((_grid(src.size),), (THREADS,), (src, np.int64(src.size), out))
    return out
