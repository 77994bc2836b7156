"""A kernel launched through ``cuLaunchKernel`` with its parameters in named ctypes slots, built once.

A :class:`SlottedKernel` holds one compiled function (a CUDA C kernel, e.g. ``ep_comm.kernels.signal_wait``'s)
and a parameter block: ctypes storage per named parameter and the ``void*[]`` of their addresses. The values
that never change are written at construction; a caller writes the per-call ones into their slots
(:meth:`SlottedKernel.slot`) and launches on a stream. The driver copies the parameters at the launch (a CUDA
graph capture records them), so the slots may be rewritten as soon as a launch returns.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Sequence, Tuple

from ep_comm._launcher import raw

__all__ = ["SlottedKernel", "address"]


def address(a: Any) -> int:
    """The device address of CuPy array ``a`` (``a.data.ptr``), 0 (NULL) for None."""
    return 0 if a is None else int(a.data.ptr)


class SlottedKernel:
    """One compiled kernel, launched on one CTA of ``threads`` threads with a parameter block built once.

    Args:
        name: the kernel's name (in launch errors).
        params: ``(parameter, ctypes type)`` in the order of the kernel's signature (pointers as 64-bit addresses).
        threads: threads of the one CTA.
        values: a value for every parameter the calls do not give (addresses as ints, see :func:`address`).
        function: ``(driver handle, owner)`` of the compiled kernel; the owner is held (it keeps the module
            loaded).
    """

    __slots__ = ("name", "_threads", "_slots", "_params", "_address", "_function", "_owner")

    def __init__(self, name: str, params: Sequence[Tuple[str, type]], threads: int, values: Dict[str, int],
                 function: Tuple[int, object]):
        self.name = name
        self._threads = threads
        self._slots = {param: ctype() for param, ctype in params}
        for param, value in values.items():
            if param not in self._slots:
                raise ValueError(f"values names {param!r}: kernel {name} takes {[p for p, _ in params]}")
            self._slots[param].value = value
        self._params = (ctypes.c_void_p * len(params))(*(ctypes.addressof(self._slots[p]) for p, _ in params))
        self._address = ctypes.addressof(self._params)
        handle, self._owner = function
        self._function = handle

    def takes(self, param: str) -> bool:
        """Whether the kernel has a parameter ``param``."""
        return param in self._slots

    def slot(self, param: str) -> Any:
        """The ctypes storage of parameter ``param``: what its ``value`` holds goes to the next launches."""
        return self._slots[param]

    def __call__(self, stream: int) -> None:
        """Launch on the stream whose handle is ``stream`` (0: the legacy default stream) with the parameters
        as their slots hold them now."""
        raw.launch(self._function, 1, self._threads, 0, stream, self._address, f"kernel {self.name}")
