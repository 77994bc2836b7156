"""A simulated ``world.World`` whose payloads are packed FP8 rows, narrower than the symmetric rows (the payload of an
FP8 dispatch in the rows of the Buffer's): shared by the FP8 kernel tests and the forwarding tests."""
from __future__ import annotations

import dataclasses

import numpy as np
from world import kernel_world

from ep_comm.contract import fp8
from ep_comm.contract.symmetric import symmetric_views, word_dtype
from ep_comm.launching.fp8 import Fp8Rows
from ep_comm.testing.dtypes import DTYPES


def payload(rng, shape, dtype: str) -> np.ndarray:
    """Normal values of several magnitudes per block, some zero blocks, a -0.0 and a subnormal-only block."""
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, size=(shape[0], 1))
    x = x.astype(DTYPES[dtype])
    if shape[0] > 2:
        x[1, : fp8.BLOCK] = 0
        x[2, 0] = -0.0
        x[2, fp8.BLOCK:] = (np.float32(1e-40) * (np.arange(shape[1] - fp8.BLOCK) % 5)).astype(DTYPES[dtype])
    return x


def narrow_world(xp, seed: int, hidden: int, dtype: str = "bfloat16", source: str = "rows", **kw):
    """A simulated world (``world.kernel_world``) whose payloads are packed FP8 rows of ``hidden``
    elements, viewed in ``dtype`` (``packed_row_bytes(hidden) / itemsize`` columns), over symmetric buffers sized
    for ``hidden`` elements of ``dtype``: the narrower payload of an FP8 dispatch in the rows of the Buffer's.
    ``source``: what the scatter reads, the packed rows themselves (``"rows"``), or an ``Fp8Rows`` of the pair
    (``"pair"``) or of the payload the rows quantize (``"cast"``)."""
    itemsize = DTYPES[dtype].itemsize
    width = fp8.packed_row_bytes(hidden) // itemsize
    world = kernel_world(xp, seed=seed, hidden=width, dtype=dtype, **kw)
    rng = np.random.default_rng(seed)
    values = [payload(rng, (len(x), hidden), dtype) for x in world.x]
    pairs = [fp8.quantize(v) for v in values]
    world.x = [fp8.pack(*pair).view(x.dtype) for pair, x in zip(pairs, world.x)]
    if source == "pair":
        world.sources = [Fp8Rows(xp.asarray(q.view(np.uint8)), xp.asarray(s), DTYPES[dtype]) for q, s in pairs]
    elif source == "cast":
        world.sources = [Fp8Rows(world.device_payload(v), None, DTYPES[dtype]) for v in values]
    world.sym = dataclasses.replace(world.sym, hidden=hidden)
    world.buffers = [xp.zeros(world.sym.total_bytes, np.uint8) for _ in range(world.num_ranks)]
    world.views = [symmetric_views(b, world.sym, word_dtype(hidden, itemsize)) for b in world.buffers]
    assert word_dtype(width, itemsize) == word_dtype(hidden, itemsize) == np.uint64  # the kernels' words, both sides
    return world
