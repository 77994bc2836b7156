"""Every private numba-cuda internal that ep_comm relies on, behind one small interface.

Verified with numba-cuda 0.30.4 (``pyproject.toml`` caps it there): a newer release may move or
rename any of these, and this module is the one place to adapt. Public APIs (``numba.cuda``,
``numba.cuda.extending``) are used directly where they are needed.

- :data:`ENABLE_CUDASIM`: whether ``numba.cuda`` is the CUDA simulator (chosen by the environment
  variable ``NUMBA_ENABLE_CUDASIM`` before ``numba.cuda`` is first imported);
- :func:`interface_sync_disabled`: launches that skip the stream sync Numba does for a
  ``__cuda_array_interface__`` argument naming a stream;
- :func:`set_source_stamp` / :func:`source_stamp`: the key of a dispatcher's on-disk cache entries;
- :func:`runtime_off` and :func:`compile_without_runtime`: kernels compiled without Numba's runtime (NRT) calls,
  whatever ``NUMBA_CUDA_ENABLE_NRT`` says;
- :func:`compiles`, :func:`launchable_overload`, :func:`kernel_handle`, :func:`stream_handle` and
  :data:`numba_types`: what the pre-bound launches (``ep_comm._launcher.prebound`` and its parameter blocks,
  ``ep_comm._launcher.param_blocks``) take from Numba's dispatcher, its driver and its type system.
"""
from __future__ import annotations

from typing import Any, ContextManager, Optional, Tuple

from numba.core import types as numba_types
from numba.cuda.core import config as _config
from numba.cuda.core.compiler_lock import global_compiler_lock as _compiler_lock
from numba.cuda.cudadrv import driver as _driver

__all__ = ["ENABLE_CUDASIM", "interface_sync_disabled", "set_source_stamp", "source_stamp", "runtime_off",
           "compile_without_runtime", "compiles_without_runtime", "compiles",
           "launchable_overload", "kernel_handle", "stream_handle", "numba_types"]

ENABLE_CUDASIM: bool = bool(_config.ENABLE_CUDASIM)


class _InterfaceSyncDisabled:
    """The context :func:`interface_sync_disabled` returns (a class: no generator per launch sequence)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        self._saved = _config.CUDA_ARRAY_INTERFACE_SYNC
        _config.CUDA_ARRAY_INTERFACE_SYNC = 0

    def __exit__(self, *exc: Any) -> None:
        _config.CUDA_ARRAY_INTERFACE_SYNC = self._saved


def interface_sync_disabled() -> ContextManager[None]:
    """Within the block, Numba does not synchronize the stream a ``__cuda_array_interface__``
    argument names (``CUDA_ARRAY_INTERFACE_SYNC=0``); the previous setting comes back after it."""
    return _InterfaceSyncDisabled()


def _cache_file(dispatcher: Any) -> Any:
    """The on-disk cache file object of a ``cuda.jit(cache=True)`` dispatcher (None: it has none)."""
    return getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)


def set_source_stamp(dispatcher: Any, stamp: str) -> None:
    """Key ``dispatcher``'s cache entries on ``stamp`` instead of its source file's modification time
    and size. No-op where there is no such stamp (the simulator caches nothing)."""
    cache_file = _cache_file(dispatcher)
    if hasattr(cache_file, "_source_stamp"):
        cache_file._source_stamp = stamp


def source_stamp(dispatcher: Any) -> Optional[Any]:
    """The stamp ``dispatcher``'s cache entries are keyed on (None: it caches nothing)."""
    return getattr(_cache_file(dispatcher), "_source_stamp", None)


class _RuntimeOff:
    """The context :func:`runtime_off` returns."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        _compiler_lock.acquire()
        self._saved = getattr(_config, "CUDA_ENABLE_NRT", False)
        _config.CUDA_ENABLE_NRT = False

    def __exit__(self, *exc: Any) -> None:
        _config.CUDA_ENABLE_NRT = self._saved
        _compiler_lock.release()


def runtime_off() -> ContextManager[None]:
    """Within the block, Numba compiles and links kernels without its runtime (``CUDA_ENABLE_NRT`` off), under
    Numba's compiler lock (no other thread compiles meanwhile, so none sees the setting); the previous setting
    comes back after it. With the runtime on, every array a kernel slices or hands to a device function gets a
    reference count call (``NRT_incref``/``NRT_decref``, a real call into a separately linked module): dozens of
    call sites per kernel and tens of registers more (ptxas: the bfloat16 combine reduce 114 registers with them, 55
    without). Kernels that allocate nothing on the device need none of it."""
    return _RuntimeOff()


def compile_without_runtime(dispatcher: Any) -> None:
    """Make every compile of ``dispatcher`` (its disk-cache loads and its links included: Numba's ``compile``
    does both) run under :func:`runtime_off`."""
    compile_with_runtime = dispatcher.compile

    def compile(sig: Any) -> Any:
        with runtime_off():
            return compile_with_runtime(sig)

    compile.without_runtime = True  # type: ignore[attr-defined]
    dispatcher.compile = compile


def compiles_without_runtime(dispatcher: Any) -> bool:
    """Whether :func:`compile_without_runtime` was applied to ``dispatcher``."""
    return getattr(dispatcher.compile, "without_runtime", False)


def compiles(dispatcher: Any) -> bool:
    """Whether ``dispatcher`` compiles its kernels and keeps the overloads (the simulator's runs Python)."""
    return hasattr(dispatcher, "overloads")


def launchable_overload(dispatcher: Any, numba_args: Any) -> Optional[Tuple[Any, Tuple[Any, ...]]]:
    """``(overload, argument types)`` that a compiling ``dispatcher`` chose for ``numba_args`` (what Numba's own
    launch got), or None where there is none or it is a debug or cooperative kernel or has argument
    extensions: launching those takes more than the plain parameter list."""
    arg_types = tuple(dispatcher.typeof_pyval(a) for a in numba_args)
    overload = dispatcher.overloads.get(arg_types)
    if overload is None or overload.debug or overload.cooperative or overload.extensions:
        return None
    return overload, arg_types


def kernel_handle(overload: Any) -> int:
    """The driver handle (a ``CUkernel``, which ``cuLaunchKernel`` takes as its ``CUfunction``) of a
    compiled overload, in the current device's context, as an integer."""
    return int(overload._codelibrary.get_cufunc().kernel.handle)


def stream_handle(stream: Any) -> int:
    """The driver handle of a Numba stream as Numba's own launch sees it, as an integer (0: the default
    stream, ``stream`` 0 included)."""
    return int(_driver._to_core_stream(stream).handle)
