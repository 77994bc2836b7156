"""Pre-bound launches of Numba-CUDA kernels: the compiled kernel, launched without Numba's dispatcher.

A Numba launch types every argument, resolves the overload and converts each array to a device
array on every call: 80-230 us of Python per launch on the H200 machines, far more than the
kernels take at decode sizes. :class:`PreboundKernel` does that work once per *argument kind* (array
dtype, rank and contiguity; scalar type; tuples of those: :func:`~ep_comm._launcher.param_blocks.arg_kind`):
the first launch of a kind goes through Numba (which compiles it if needed), then the overload Numba chose
is looked up and every later launch of that kind goes straight to the driver (``cuLaunchKernel``) with a
*parameter block* (:class:`~ep_comm._launcher.param_blocks.ParamBlock`: ctypes storage for every kernel
parameter in Numba's ABI and the ``void*[]`` array of their addresses), kept per launch configuration (grid,
block, shared bytes) and filled once; a launch rewrites only the arguments that differ from the ones the
block last took.

Anything else (records, complex numbers, debug or cooperative kernels, kernels with argument
extensions) keeps Numba's own launch path. What this takes from Numba's dispatcher and driver
comes through :mod:`ep_comm.kernels.numba_internals`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ep_comm._launcher import raw
from ep_comm._launcher.device_arrays import DeviceViews
from ep_comm._launcher.occupancy import quiet_low_occupancy
from ep_comm._launcher.param_blocks import ParamBlock, arg_kind, param_slot
from ep_comm.kernels.numba_internals import compiles, kernel_handle, launchable_overload, stream_handle

__all__ = ["PreboundKernel", "Recorded", "prebound_kernel", "recording"]


Config = Tuple[int, int, int]
Recorded = Tuple[Optional["_ArgBinding"], Config, Tuple[Any, ...]]  # (binding or None: unbindable, config, args)
_RECORDING = threading.local()  # .seen: the list this thread's launches are recorded into, while one is open


@contextmanager
def recording() -> Iterator[List[Recorded]]:
    """Inside, every :class:`PreboundKernel` launch this thread makes (pre-bound or through Numba) is also appended,
    as ``(binding, config, args)``, to the list yielded (``binding`` None where the launch could not be bound): what a
    recorded call (:mod:`ep_comm._launcher.recorded_calls`) is built from. Per thread (two Buffers on two threads record
    apart); not reentrant."""
    if getattr(_RECORDING, "seen", None) is not None:
        raise RuntimeError("launches are already being recorded on this thread")
    _RECORDING.seen = seen = []
    try:
        yield seen
    finally:
        _RECORDING.seen = None


class _ArgBinding:
    """One argument kind of one kernel: Numba's overload (``types``: its signature), its driver handle,
    and free parameter blocks per launch configuration."""

    def __init__(self, overload: Any, types: Tuple[Any, ...], key: Tuple[Any, ...], name: str):
        self.overload = overload
        self.types = types
        self.key = key
        self.name = name
        self.function = kernel_handle(overload)  # the driver handle
        self._free: Dict[Config, List[ParamBlock]] = {}

    def block(self) -> Optional[ParamBlock]:
        """A new parameter block (None: some argument type is not bound)."""
        slots = [param_slot(t, k) for t, k in zip(self.types, self.key)]
        return None if any(s is None for s in slots) else ParamBlock(slots)

    def free(self, config: Config) -> List[ParamBlock]:
        """The free blocks of ``config``: a launch pops one (or makes one) and puts it back after the
        driver has copied its parameters, so that launches from two threads never share a block."""
        return self._free.setdefault(config, [])


class PreboundKernel:
    """Launches one Numba ``@cuda.jit`` dispatcher; after the first launch of each argument kind,
    without the dispatcher.

    ``to_numba`` turns an argument into what Numba's own launch takes (see
    :class:`ep_comm._launcher.device_arrays.DeviceViews`).
    ``enabled=False`` (the CUDA simulator, or ``EP_COMM_NUMBA_LAUNCH=1``) always launches through
    Numba.
    """

    def __init__(self, dispatcher: Any, to_numba: Callable[[Any], Any], enabled: bool = True):
        self.dispatcher = dispatcher
        self._to_numba = to_numba
        self._enabled = enabled and compiles(dispatcher)
        self._bindings: Dict[Tuple[Any, ...], Optional[_ArgBinding]] = {}
        self._recent: Dict[Config, Tuple[_ArgBinding, List[ParamBlock]]] = {}  # the binding last launched per config
        self._streams: Dict[int, Tuple[Any, Any]] = {}

    def __call__(self, grid: int, block: int, stream: Any, shared_bytes: int, *args: Any) -> None:
        """Launch ``grid`` blocks of ``block`` threads with ``shared_bytes`` of dynamic shared memory
        on ``stream`` (a Numba stream or 0: the default stream)."""
        if self._enabled:
            config = (grid, block, shared_bytes)
            recent = self._recent.get(config)
            if recent is not None and self._launch_packed(recent[0], recent[1], config, stream, args):
                self._record(recent[0], config, args)
                return
            key = tuple(arg_kind(a) for a in args)
            binding = self._bindings.get(key)
            if binding is not None:
                free = binding.free(config)
                self._recent[config] = (binding, free)
                if self._launch_packed(binding, free, config, stream, args):
                    self._record(binding, config, args)
                    return
        numba_args = [self._to_numba(a) for a in args]
        with quiet_low_occupancy():  # small grids are deliberate: no warning per launch
            self.dispatcher[grid, block, stream, shared_bytes](*numba_args)
        if self._enabled and key not in self._bindings:
            self._bindings[key] = self._bind(key, numba_args)
        self._record(self._bindings.get(key) if self._enabled else None, (grid, block, shared_bytes), args)

    @staticmethod
    def _record(binding: Optional[_ArgBinding], config: Config, args: Tuple[Any, ...]) -> None:
        """Append the launch to the open recording (:func:`recording`), if any."""
        seen = getattr(_RECORDING, "seen", None)
        if seen is not None:
            seen.append((binding, config, args))

    def _launch_packed(self, binding: _ArgBinding, free: List[ParamBlock], config: Config, stream: Any,
                       args: tuple) -> bool:
        """Launch ``binding`` with ``args`` patched into a free block of ``config``; False (nothing launched)
        where ``args`` are not of the binding's kinds."""
        try:
            packed = free.pop()
        except IndexError:  # another thread holds it, or this config's first launch
            packed = binding.block()
        if not packed.patch(args):
            free.append(packed)
            return False
        try:
            raw.launch(binding.function, config[0], config[1], config[2], self._stream(stream), packed.address,
                       f"kernel {binding.name}")
        finally:
            free.append(packed)  # the driver has copied the parameters
        return True

    def _bind(self, key: Tuple[Any, ...], numba_args: List[Any]) -> Optional[_ArgBinding]:
        """The binding of ``key`` from the overload Numba just launched (None: keep Numba's launch)."""
        if any(k is None for k in key):
            return None
        chosen = launchable_overload(self.dispatcher, numba_args)
        if chosen is None:
            return None
        binding = _ArgBinding(*chosen, key, getattr(self.dispatcher, "__name__", repr(self.dispatcher)))
        if binding.block() is None:
            return None
        if getattr(self.dispatcher, "programmatic_launch", False):  # compiled with griddepcontrol (kernels/pdl.py)
            raw.allow_programmatic(binding.function)
        return binding

    def _stream(self, stream: Any) -> int:
        """The driver handle of a Numba stream (0: the default stream), kept with its source."""
        held = self._streams.get(id(stream))
        if held is None or held[0] is not stream:
            held = self._streams[id(stream)] = (stream, stream_handle(stream))
        return held[1]


_DEVICE_VIEWS = DeviceViews()
_BOUND: dict = {}


def prebound_kernel(kernel: Any, device: Optional[int]) -> PreboundKernel:
    """The process's one :class:`PreboundKernel` of ``kernel`` on CUDA device ``device`` (None: launches
    through Numba, as in the simulator). Its bindings depend only on the kernel, the device (a compiled
    function belongs to one device's context) and the argument kinds, so every ``Kernels`` (every
    Buffer) shares them and binds each kind once."""
    bound = _BOUND.get((kernel, device))
    if bound is None:
        bound = _BOUND[kernel, device] = PreboundKernel(kernel, _DEVICE_VIEWS, enabled=device is not None)
    return bound
