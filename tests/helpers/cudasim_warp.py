"""Warp intrinsics and libdevice calls for the Numba CUDA simulator, so kernels run there unchanged, and a block
runner that runs a block's simulated threads as greenlets of one OS thread.

The simulator runs the threads of a block as Python threads (one OS thread each, switched under the GIL) and lacks
warp collectives. Here a block's threads are greenlets (:func:`_run_block`) that its runner switches between: each
runs until it waits (``syncthreads``, a warp collective) or ends. ``syncthreads`` releases its waiters once every
live thread of the block waits there or has ended, as the simulator's block manager does; a warp collective
publishes the lane's value, waits for the lanes of its warp, reads the published values, and waits again so the
next collective cannot overwrite them early. Kernels call collectives with all lanes of a warp (full mask), as they
must on a GPU. Threads run in a fixed order (thread 0 up to its next wait, then thread 1, ...), where Python
threads ran in whatever order the GIL gave; a block whose threads all wait but not at one barrier (a lane that
ended before its warp's collective) raises at once instead of hanging.

The root ``tests/conftest.py`` calls :func:`use_without_gpu` once, before anything imports
``numba.cuda`` (which reads ``NUMBA_ENABLE_CUDASIM`` when first imported): this module itself
imports no Numba (nor greenlet) at load, and :func:`install` imports the simulator's modules only when it runs.
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
import threading

import numpy as np

HAVE_GPU = shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")
WARP = 32
_installed = False  # whether use_without_gpu ran
_getcurrent = None  # greenlet.getcurrent, once install() ran


class _Warp:
    """A warp of a running block: its lanes (32, fewer in a block's last partial warp), the values its lanes
    published for the collective under way, and the lanes that wait for the others."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.values: list = [None] * WARP
        self.waiting: list = []


def _current():
    """The simulated thread of the running greenlet."""
    return _getcurrent().sim_thread


def _wait(barrier) -> None:
    """Hand the block's runner this thread's wait at ``barrier`` (a ``_Warp``, or None: ``syncthreads``); returns
    when the runner resumes it, once the barrier is complete."""
    _getcurrent().parent.switch(barrier)


def _exchange(value) -> tuple[list, int]:
    """All lanes' values (None for lanes that do not exist) and the caller's lane."""
    thread = _current()
    warp_idx, lane = divmod(thread.thread_id, WARP)
    warp = thread._manager.sim_warps[warp_idx]
    warp.values[lane] = value
    _wait(warp)
    values = list(warp.values)
    _wait(warp)
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


class _SimThread:
    """One simulated CUDA thread: what the simulator's kernel API reads of ``threading.current_thread()`` (its
    indices, ``syncthreads`` and the block reductions), for the greenlet that runs it."""

    def __init__(self, manager, grid_point: tuple, block_point: tuple):
        from numba.cuda.simulator.kernelapi import Dim3

        self._manager = manager
        self.blockIdx, self.threadIdx = Dim3(*grid_point), Dim3(*block_point)
        dim = Dim3(*manager._block_dim)
        self.thread_id = self.threadIdx.x + dim.x * (self.threadIdx.y + dim.y * self.threadIdx.z)
        self.exception = None

    def syncthreads(self) -> None:
        _wait(None)

    def _reduced(self, value, reduce):
        state = self._manager.block_state
        state[self.threadIdx.x, self.threadIdx.y, self.threadIdx.z] = value
        self.syncthreads()
        result = reduce(state)
        self.syncthreads()
        return result

    def syncthreads_count(self, value):
        return self._reduced(value, np.count_nonzero)

    def syncthreads_and(self, value):
        return self._reduced(value, lambda state: 1 if np.all(state) else 0)

    def syncthreads_or(self, value):
        return self._reduced(value, lambda state: 1 if np.any(state) else 0)

    def run(self, kernel, args) -> None:
        """The kernel on this thread; an exception is kept (as ``BlockThread.run`` keeps it: its message names the
        thread and block) for the runner to raise."""
        try:
            kernel(*args)
        except Exception as e:
            where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
            self.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])


class _Threading:
    """``threading`` as the simulator's kernel API sees it: ``current_thread()`` is the running greenlet's simulated
    thread (the API reads ``threadIdx``, ``blockIdx``, ``syncthreads`` ... from it), the rest is ``threading``."""

    def __getattr__(self, name: str):
        return getattr(threading, name)

    @staticmethod
    def current_thread():
        return getattr(_getcurrent(), "sim_thread", None) or threading.current_thread()


def _run_block(manager, grid_point, *args) -> None:
    """``BlockManager.run`` with the block's threads as greenlets of this OS thread (the simulator starts one Python
    thread per CUDA thread: thread creation, GIL hand-offs and futex waits were most of a kernel test's CPU): each
    thread runs until it waits or ends; a complete warp barrier resumes its lanes, and ``syncthreads`` its waiters
    once every live thread waits there or has ended. A thread's exception is raised (the others are dropped, as the
    simulator aborts them); a block whose threads all wait but no barrier is complete raises RuntimeError."""
    from greenlet import greenlet

    count = int(np.prod(manager._block_dim))
    manager.sim_warps = [_Warp(min(WARP, count - first)) for first in range(0, count, WARP)]
    ready = collections.deque()
    for point in np.ndindex(*manager._block_dim):
        thread = _SimThread(manager, grid_point, point)
        runner = greenlet(thread.run)
        runner.sim_thread = thread
        ready.append((runner, (manager._f, args)))
    in_sync, ended = [], 0
    while True:
        while ready:
            runner, start = ready.popleft()
            barrier = runner.switch(*start)
            thread = runner.sim_thread
            if thread.exception is not None:
                raise thread.exception[0].with_traceback(thread.exception[1])
            if runner.dead:
                ended += 1
            elif barrier is None:
                in_sync.append((runner, ()))
            else:
                barrier.waiting.append((runner, ()))
                if len(barrier.waiting) == barrier.lanes:
                    ready.extend(barrier.waiting)
                    barrier.waiting = []
        if ended == count:
            return
        if not in_sync or len(in_sync) + ended < count:
            raise RuntimeError(f"simulated block {tuple(grid_point)} cannot go on: {ended} of {count} threads ended, "
                               f"{len(in_sync)} wait in syncthreads, the others in warp collectives")
        ready.extend(in_sync)
        in_sync = []


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
    """Add the warp intrinsics to the simulator's ``cuda`` module and the libdevice calls kernels use; blocks run
    their threads as greenlets (:func:`_run_block`); kernels take host arrays in place (:func:`_in_place`)."""
    global _getcurrent
    from greenlet import getcurrent
    from numba.cuda import libdevice
    from numba.cuda.simulator import args, kernelapi
    from numba.cuda.simulator.kernel import BlockManager
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    _getcurrent = getcurrent
    if not getattr(args.InOut.to_device, "in_place", False):
        args.InOut.to_device = _in_place(args.InOut.to_device)
        args.InOut.to_device.in_place = True

    for name, func in _INTRINSICS.items():
        setattr(FakeCUDAModule, name, func)
    for name, func in _LIBDEVICE.items():
        setattr(libdevice, name, func)
    kernelapi.threading = _Threading()
    BlockManager.run = _run_block


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
