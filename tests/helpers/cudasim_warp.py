"""Warp intrinsics and libdevice calls for the Numba CUDA simulator, so kernels run there unchanged.

The simulator runs the threads of a block as Python threads and lacks warp collectives. Here each
warp gets a barrier: a collective publishes the lane's value, waits for the warp, reads the
published values, and waits again so the next collective cannot overwrite them early. Kernels
call collectives with all lanes of a warp (full mask), as they must on a GPU.

A block's manager sleeps until its threads wait in ``syncthreads`` or end (:func:`_run_block`), instead of the
simulator's loop that polls them while holding the GIL.

The root ``tests/conftest.py`` calls :func:`use_without_gpu` once, before anything imports
``numba.cuda`` (which reads ``NUMBA_ENABLE_CUDASIM`` when first imported): this module itself
imports no Numba at load, and :func:`install` imports the simulator's modules only when it runs.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading

import numpy as np

HAVE_GPU = shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")
WARP = 32
_TIMEOUT_S = 60.0
_state_lock = threading.Lock()
_installed = False  # whether use_without_gpu ran


class _Warp:
    def __init__(self, lanes: int):
        self.barrier = threading.Barrier(lanes)
        self.values: list = [None] * WARP


def _warp_of_current_thread() -> tuple[_Warp, int]:
    thread = threading.current_thread()
    manager = thread._manager
    warp_idx, lane = divmod(thread.thread_id, WARP)
    with _state_lock:
        warps = manager.__dict__.setdefault("_warps", {})
        if warp_idx not in warps:
            threads = int(np.prod(manager._block_dim))
            warps[warp_idx] = _Warp(min(WARP, threads - warp_idx * WARP))
    return warps[warp_idx], lane


def _exchange(value) -> tuple[list, int]:
    """All lanes' values (None for lanes that do not exist) and the caller's lane."""
    warp, lane = _warp_of_current_thread()
    warp.values[lane] = value
    warp.barrier.wait(_TIMEOUT_S)
    values = list(warp.values)
    warp.barrier.wait(_TIMEOUT_S)
    return values, lane


def _check_full(mask) -> None:
    if int(mask) & 0xFFFFFFFF != 0xFFFFFFFF:
        raise NotImplementedError("the simulator's warp intrinsics support only the full mask")


def shfl_sync(self, mask, value, src_lane):
    _check_full(mask)
    values, _ = _exchange(value)
    return values[int(src_lane) % WARP]


def shfl_up_sync(self, mask, value, delta):
    _check_full(mask)
    values, lane = _exchange(value)
    src = lane - int(delta)
    return values[src] if src >= 0 else value


def shfl_down_sync(self, mask, value, delta):
    _check_full(mask)
    values, lane = _exchange(value)
    src = lane + int(delta)
    return values[src] if src < WARP and values[src] is not None else value


def shfl_xor_sync(self, mask, value, lane_mask):
    _check_full(mask)
    values, lane = _exchange(value)
    src = lane ^ int(lane_mask)
    return values[src] if values[src] is not None else value


def _typed_mask(lanes) -> np.int64:
    """A lane mask as compiled code sees it: Numba types ballot/match results int32, and any arithmetic
    widens them to int64, sign-extending lane 31's bit (NumPy would keep an int32 at int32)."""
    return np.int64(np.uint32(sum(1 << i for i in lanes)).view(np.int32))


def ballot_sync(self, mask, predicate):
    _check_full(mask)
    values, _ = _exchange(bool(predicate))
    return _typed_mask(i for i, v in enumerate(values) if v)


def match_any_sync(self, mask, value):
    _check_full(mask)
    values, lane = _exchange(value)
    return _typed_mask(i for i, v in enumerate(values) if v is not None and v == values[lane])


def activemask(self):
    values, _ = _exchange(True)
    return np.uint32(sum(1 << i for i, v in enumerate(values) if v))


def popc(self, value):
    """Set bits of the two's complement of ``value`` at its width (64 for Python ints, as Numba's int64)."""
    bits = np.dtype(value.dtype).itemsize * 8 if isinstance(value, np.generic) else 64
    return bin(int(value) & ((1 << bits) - 1)).count("1")


def syncwarp(self, mask=0xFFFFFFFF):
    _check_full(mask)
    _exchange(None)


def ldcv(self, array, index):
    return array[index]


_INTRINSICS = {f.__name__: f for f in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, ballot_sync,
                                      match_any_sync, activemask, popc, syncwarp, ldcv)}


def _fadd_rn(x, y):
    return np.float32(np.float32(x) + np.float32(y))


def _fmul_rn(x, y):
    return np.float32(np.float32(x) * np.float32(y))


def _fdiv_rn(x, y):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(np.float32(x) / np.float32(y))


def _float_as_int(x):
    return np.float32(x).view(np.int32)


def _int_as_float(x):
    return np.uint32(int(x) & 0xFFFFFFFF).view(np.float32)


_LIBDEVICE = {"fadd_rn": _fadd_rn, "fmul_rn": _fmul_rn, "fdiv_rn": _fdiv_rn, "float_as_int": _float_as_int, "int_as_float": _int_as_float}


class _BlockState:
    """What a simulated block's threads tell its manager: how many wait in ``syncthreads`` and how many ended,
    under one condition the manager sleeps on (no polling)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.blocked: list = []
        self.ended = 0


def _syncthreads(thread) -> None:
    """``BlockThread.syncthreads`` that wakes its block's manager (:func:`_run_block`) instead of being polled."""
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    state = thread._manager.sim_state
    with state.changed:
        thread.syncthreads_blocked = True
        state.blocked.append(thread)
        state.changed.notify()
    thread.syncthreads_event.wait()
    thread.syncthreads_event.clear()
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_run(run):
    """``BlockThread.run`` (``run``) that tells its block's manager when the thread has ended, raised or not."""

    def wrapped(thread) -> None:
        try:
            run(thread)
        finally:
            state = thread._manager.sim_state
            with state.changed:
                state.ended += 1
                state.changed.notify()

    return wrapped


def _run_block(manager, grid_point, *args) -> None:
    """``BlockManager.run`` without its polling loop, which holds the GIL between the simulated threads' steps and
    sleeps to let them run (most of a simulator test's wall time, little of its CPU): the manager sleeps until every
    live thread waits in ``syncthreads`` (then releases them all) or has ended, or one raised (then aborts the
    others and raises it, as the simulator does)."""
    from numba.cuda.simulator.kernel import BlockThread

    state = manager.sim_state = _BlockState()
    threads = [BlockThread(lambda: manager._f(*args), manager, grid_point, point, manager._debug)
               for point in np.ndindex(*manager._block_dim)]
    for thread in threads:
        thread.start()
    with state.changed:
        while True:
            state.changed.wait_for(lambda: any(t.exception for t in threads)
                                   or len(state.blocked) + state.ended == len(threads))
            failed = next((t for t in threads if t.exception), None)
            if failed is not None:
                for other in threads:
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            if state.ended == len(threads):
                return
            for thread in state.blocked:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
            state.blocked = []


def _in_place(copying):
    """The simulator's ``InOut.to_device`` for host arrays: the array itself as the simulator's device array, no copy
    in or out (``copying`` for anything else). Kernels then read and write the host memory in place, as a GPU kernel
    does its arguments' memory, whatever the array's strides: the simulator's own copy takes contiguous arrays only,
    and a user's strided or transposed input is a case the tests must run."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    def to_device(self, retr, stream=0):
        return FakeCUDAArray(self.value) if isinstance(self.value, np.ndarray) else copying(self, retr, stream)

    return to_device


def install() -> None:
    """Add the warp intrinsics to the simulator's ``cuda`` module and the libdevice calls kernels use; kernels take
    host arrays in place (:func:`_in_place`)."""
    from numba.cuda import libdevice
    from numba.cuda.simulator import args
    from numba.cuda.simulator.kernel import BlockManager, BlockThread
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    if not getattr(args.InOut.to_device, "in_place", False):
        args.InOut.to_device = _in_place(args.InOut.to_device)
        args.InOut.to_device.in_place = True

    for name, func in _INTRINSICS.items():
        setattr(FakeCUDAModule, name, func)
    for name, func in _LIBDEVICE.items():
        setattr(libdevice, name, func)
    if not getattr(BlockManager.run, "event_driven", False):
        BlockThread.run = _thread_run(BlockThread.run)
        BlockThread.syncthreads = _syncthreads
        BlockManager.run = _run_block
        BlockManager.run.event_driven = True


def use_without_gpu() -> bool:
    """Without a GPU, select the simulator (unless ``NUMBA_ENABLE_CUDASIM`` is set already) and, if
    ``numba.cuda`` is then the simulator, :func:`install` the intrinsics. Returns whether it is."""
    global _installed
    _installed = True
    select_without_gpu()
    from ep_comm.kernels.numba_internals import ENABLE_CUDASIM

    if ENABLE_CUDASIM:
        install()
    return ENABLE_CUDASIM


def select_without_gpu() -> None:
    """Without a GPU, select the simulator (unless ``NUMBA_ENABLE_CUDASIM`` is set already); imports nothing."""
    if not HAVE_GPU:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def install_if_imported() -> None:
    """:func:`use_without_gpu` once ``numba.cuda`` has been imported (nothing before: no Numba import for a session
    that never needs it, such as a rank of the collective suites on the mpi backend)."""
    if not _installed and "numba.cuda" in sys.modules:
        use_without_gpu()
