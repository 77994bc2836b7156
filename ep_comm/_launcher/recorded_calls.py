"""Recorded calls: the kernel launches of one call shape, recorded once, then launched again with new data pointers.

An eager call of a Buffer launches the same kernels with the same shapes, scalars and grids at every call of
one shape (token count, mode, options); only the data pointers of its per-call arrays change (the caller's
``x`` and ``topk_idx``, the call's outputs and scratch). A :class:`RecordedCall` is built from one recorded call
(:func:`ep_comm._launcher.prebound.recording`): per launch the compiled function, the launch configuration and a
parameter block with every slot filled; for each array parameter that lies inside one of the call's *roots*
(the per-call arrays the caller names) the root's index and the byte offset. A replay writes
``root pointer + offset`` into those slots and launches, one driver call per kernel
(:func:`ep_comm._launcher.raw.launch`): no argument typing, no views, no allocation.

A replay keeps every other word of the recorded parameter blocks: shapes, strides, scalars, grids, and the
kernel specialisation that Numba chose for each array's dtype and layout. So a recorded call is looked up by
the caller's key (its scalars and options) *and* the layout of its roots: shape, byte strides, dtype and the
data pointer modulo 16 of each (:meth:`RecordedCalls.shape_key`), computed here from the roots themselves, so that no
caller can leave one out (``docs/design.md``, "Recorded calls", states the rule). A root may have any strides
(a transposed or strided view): its byte span runs from its lowest to its highest element.

Every array parameter outside the roots is taken as long-lived (workspaces, symmetric-heap views, stand-ins):
the recorded call holds a reference to it. A caller must therefore name as roots every array a call makes or is
given: :class:`RecordedCalls` refuses to record a call that allocated anything through the array module's allocator
outside its roots (``allocations``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

from cuda.bindings.driver import CUstream

from ep_comm._launcher import raw
from ep_comm._launcher.param_blocks import ParamBlock, _ArraySlot, _TupleSlot, array_fields
from ep_comm._launcher.prebound import Recorded, recording

__all__ = ["RecordedCall", "RecordedCalls", "record_call"]

_DATA = 4  # the data pointer's index among an array parameter's words (param_blocks: meminfo, parent, nitems, itemsize)

PointerSlot = Tuple[Any, int, int]  # (ctypes words of one array parameter, root index, byte offset in the root)


class _RecordedLaunch:
    """One recorded launch: function, configuration, its parameter block and the block's per-call pointers."""

    __slots__ = ("function", "grid", "block", "shared", "params", "pointers", "name")

    def __init__(self, function: Any, config: Tuple[int, int, int], params: ParamBlock,
                 pointers: Tuple[PointerSlot, ...], name: str):
        self.function = function
        self.grid, self.block, self.shared = config
        self.params = params
        self.pointers = pointers
        self.name = name


class RecordedCall:
    """The launches of one recorded call; :meth:`__call__` replays them with new root pointers.

    ``held``: the long-lived arrays the parameter blocks point into (kept alive with the recorded call).
    """

    __slots__ = ("launches", "held")

    def __init__(self, launches: Sequence[_RecordedLaunch], held: Sequence[Any]):
        self.launches = tuple(launches)
        self.held = tuple(held)

    def __len__(self) -> int:
        return len(self.launches)

    def __call__(self, on: CUstream, roots: Sequence[int]) -> None:
        """Launch every kernel of the call on stream ``on``, in recorded order, each root ``i``'s arrays now at
        ``roots[i]`` (device addresses)."""
        for launch in self.launches:
            for words, root, offset in launch.pointers:
                words[_DATA] = roots[root] + offset
            raw.launch(launch.function, launch.grid, launch.block, launch.shared, on, launch.params.address,
                       launch.name)


def _spans(roots: Sequence[Any]) -> List[Tuple[int, int, int]]:
    """``(first byte, past the last byte, data pointer)`` of every root, whatever its strides (a negative stride
    puts elements before the data pointer; an empty root: an empty span that matches nothing)."""
    spans = []
    for root in roots:
        ptr, shape, strides, itemsize = array_fields(root)
        low = high = 0
        for extent, stride in zip(shape, strides):
            if extent == 0:
                low, high = 0, -itemsize
                break
            reach = (extent - 1) * stride
            low, high = (low + reach, high) if reach < 0 else (low, high + reach)
        spans.append((ptr + low, ptr + high + itemsize, ptr))
    return spans


def _array_params(slots: Sequence[Any], args: Sequence[Any]) -> Iterator[Tuple[_ArraySlot, Any]]:
    """Every (array slot, array argument) pair of a parameter block and its arguments, tuples flattened."""
    for slot, arg in zip(slots, args):
        if isinstance(slot, _TupleSlot):
            yield from _array_params(slot.items, arg)
        elif isinstance(slot, _ArraySlot):
            yield slot, arg


def _root_of(ptr: int, spans: Sequence[Tuple[int, int, int]]) -> Optional[Tuple[int, int]]:
    """``(root index, offset from the root's data pointer)`` of the root whose bytes hold address ``ptr``, or
    None."""
    for i, (first, end, base) in enumerate(spans):
        if first <= ptr < end:
            return i, ptr - base
    return None


def record_call(records: Sequence[Recorded], roots: Sequence[Any]) -> Optional[RecordedCall]:
    """The :class:`RecordedCall` of a recorded call whose per-call arrays are ``roots``; None where a launch of
    it could not be bound (it went through Numba's dispatcher) or nothing was launched.

    Args:
        records: the ``(binding, config, args)`` of every launch of the call
            (:func:`~ep_comm._launcher.prebound.recording`).
        roots: the call's per-call arrays (CuPy or CUDA-array-interface), any strides.
    """
    if not records:
        return None
    spans = _spans(roots)
    launches, held = [], []
    for binding, config, args in records:
        params = None if binding is None else binding.block()
        if params is None or not params.patch(args):
            return None
        pointers = []
        for slot, arg in _array_params(params.items, args):
            found = _root_of(int(slot.store[_DATA]), spans)
            if found is None:
                held.append(arg)
            else:
                pointers.append((slot.store, *found))
        launches.append(_RecordedLaunch(binding.function, config, params, tuple(pointers), f"kernel {binding.name}"))
    return RecordedCall(launches, held)


_UNRECORDABLE = object()  # a key whose calls cannot be recorded: they always run their path


class RecordedCalls:
    """The recorded calls of one owner (a backend's Kernels), by call key.

    Args:
        enabled: False (the CUDA simulator, ``EP_COMM_NUMBA_LAUNCH=1``): every call runs its path, nothing is
            recorded.
        allocations: ``held -> context`` in which every allocation through the array module is appended to
            ``held`` (``CupyDevice.allocations_into``), or None: a call that allocates outside its roots is then
            not detected.
    """

    def __init__(self, enabled: bool, allocations: Optional[Callable[[List[Any]], Any]] = None):
        self.enabled = enabled
        self._allocations = allocations
        self._calls: Dict[Hashable, Any] = {}
        self.built = 0  # calls recorded so far (a first call at a new shape records one)

    def run(self, key: Hashable, on: CUstream, roots: Sequence[Any], path: Callable[..., None], *args: Any) -> None:
        """One call of shape ``key`` over ``roots``: launch the call recorded for ``key`` and the roots' layout
        (:meth:`shape_key`) again with the roots' pointers on stream ``on``; the first such call runs
        ``path(*args)`` (the launches through ``Kernels``, on the same stream) and records it (``args``: no
        ``functools.partial`` to build at every call of a recorded one).

        Args:
            key: what the launches' scalars and grids depend on besides the roots' layout (options, modes); None:
                a call not to be recorded (it runs ``path(*args)``).
            on: the stream (``raw.stream(handle)``).
            roots: the call's per-call arrays, in the same order at every call of ``key``: every array the call is
                given or makes that its launches read or write (any other array a launch takes is held as
                long-lived by the recorded call).
            path: the call's launches through ``Kernels`` (its arrays views of ``roots`` or long-lived).
            args: ``path``'s arguments.
        """
        if not self.enabled or key is None:
            path(*args)
            return
        pointers = [r.data.ptr for r in roots]
        shape_key = self.shape_key(key, roots, pointers)
        recorded = self._calls.get(shape_key)
        if recorded is None:
            self._calls[shape_key] = self._record(roots, path, args)
        elif recorded is _UNRECORDABLE:
            path(*args)
        else:
            recorded(on, pointers)

    @staticmethod
    def shape_key(key: Hashable, roots: Sequence[Any], pointers: Sequence[int]) -> Hashable:
        """What a recorded call is looked up by: the caller's ``key`` and the layout of its ``roots`` (at
        ``pointers``), what a replay keeps of them besides their pointers: per root its shape, byte strides, dtype
        and 16-byte misalignment (``pointer % 16``, the rows' copy width). Two calls whose roots agree on these make
        the same launches with the same words but for the roots' data pointers."""
        layout = []
        for r, p in zip(roots, pointers):  # a loop, not a comprehension: no frame of its own
            layout.append((r.shape, r.strides, r.dtype, p & 15))
        return key, tuple(layout)

    def launch_counts(self) -> Dict[Hashable, Optional[int]]:
        """Per ``(call key, roots' layout)`` seen, the launches of its recorded call (None: its calls cannot be
        recorded)."""
        return {key: None if recorded is _UNRECORDABLE else len(recorded) for key, recorded in self._calls.items()}

    def _record(self, roots: Sequence[Any], path: Callable[..., None], args: tuple) -> Any:
        """Run ``path(*args)`` recording its launches; its recorded call, or ``_UNRECORDABLE``."""
        allocated: List[Any] = []
        with recording() as seen:
            if self._allocations is None:
                path(*args)
            else:
                with self._allocations(allocated):
                    path(*args)
        recorded = None if allocated else record_call(seen, roots)
        if recorded is None:
            return _UNRECORDABLE
        self.built += 1
        return recorded
