"""The nvshmem backend's kernels compiled once per rank before the first test of a collective session.

Numba compiles (or loads from its disk cache, ``ep_comm/kernels/jit.py``) a kernel at its first launch in each
process. On a fresh GPU machine nothing is cached yet: on those of session 11 a first dispatch and combine compiled
for about 100 s per rank alone, and for over two minutes with three jobs under one MPS daemon. Inside the first test
that time ran past its hang guard (``pytest.mark.timeout``) while nothing hung. Done here, at session start and
outside every test's timeout, the first test of a file measures what it means to.

What is compiled: per payload dtype of the suites (float32, float16, bfloat16) a dispatch of a new routing and a
replay of its handle, compact and expand, ``cpu_sync`` True and False, with weights, and the combines of their
outputs (weights given in expand mode) on one Buffer of the session's backend and transport. Kernels the suites
specialise further (FP8, ``int32`` ids, forwarding) still compile in their first test.
"""
from __future__ import annotations

import time

import ep_comm
from ep_comm.backends import choose_backend
from helpers.collective import make_buffer, to_device
from helpers.oracle import RANK, World, make_world

__all__ = ["compile_kernels", "gpu_stack_present"]

PAYLOAD_DTYPES = ("float32", "float16", "bfloat16")


def gpu_stack_present() -> bool:
    """Whether the nvshmem backend can run here (CuPy, nvshmem4py and a GPU); without it the suites' Buffers raise,
    each in its test, saying why, and nothing is compiled first."""
    return choose_backend("auto").name == "nvshmem"


def compile_kernels() -> float:
    """Run the calls named in the module's docstring on every rank (collective: all ranks call it, in the same
    order); returns the seconds they took on this rank."""
    start = time.perf_counter()
    for dtype in PAYLOAD_DTYPES:
        world = make_world("masked", dtype=dtype)
        with make_buffer(world) as buf:
            for expand in (False, True):
                for cpu_sync in (True, False):
                    _round_trips(buf, world, expand, cpu_sync)
    return time.perf_counter() - start


def _round_trips(buf: ep_comm.Buffer, world: World, expand: bool, cpu_sync: bool) -> None:
    """A new routing's dispatch of this rank's tokens of ``world``, a replay of its handle, and both combines."""
    x, weights = to_device(world.x[RANK]), to_device(world.weights[RANK])
    new = buf.dispatch(x, to_device(world.topk_idx[RANK]), weights, expand=expand, cpu_sync=cpu_sync)
    for out in (new, buf.dispatch(x, None, weights, handle=new.handle, cpu_sync=cpu_sync)):
        buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights if expand else None)
