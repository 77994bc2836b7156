"""Recorded calls: the kernel launches of one call shape, recorded once, then launched again with new data pointers.

An eager call of a Buffer launches the same kernels with the same shapes, scalars and grids at every call of
one shape (token count, mode, options); only the data pointers of its per-call arrays change (the caller's
``x`` and ``topk_idx``, the call's outputs and scratch). A call is given as a function and its arguments
(:meth:`RecordedCalls.run`); :func:`call_key` reads from those arguments, in one pass, both its lookup key and its
*roots* (the arrays among them; arguments that are the same objects for the life of their holder, such as a handle's
arrays, may come as one :class:`FixedArguments`, read once). A :class:`RecordedCall` is built from the first call of a
key (:func:`ep_comm._launcher.prebound.recording`): per launch the compiled function, the launch configuration and a
parameter block with every slot filled; for each array parameter that lies inside one of the roots the root's
index and the byte offset. A replay writes ``root pointer + offset`` into those slots and launches, one driver call
per kernel (:func:`ep_comm._launcher.raw.launch`): no argument typing, no views, no allocation.

What the key must hold, and what a call may take besides its arguments, is stated once: ``docs/design.md``,
"Recorded calls" (the rule of the key). Every array parameter outside the roots is held by the recorded call as
long-lived; a call that allocates anything outside its roots is not recorded (``allocations``).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ep_comm._launcher import raw
from ep_comm._launcher.param_blocks import ParamBlock, _array, _ArraySlot, _TupleSlot, array_fields
from ep_comm._launcher.prebound import Recorded, recording

__all__ = ["FixedArguments", "RecordedCall", "RecordedCalls", "arguments", "call_key", "record_call",
           "refuse_made_per_call", "spans_overlap"]

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

    def __call__(self, on: int, roots: Sequence[int]) -> None:
        """Launch every kernel of the call on the stream whose handle is ``on``, in recorded order, each root
        ``i``'s arrays now at ``roots[i]`` (device addresses)."""
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


def spans_overlap(spans: Sequence[Tuple[int, int, int]]) -> bool:
    """Whether two of ``spans`` (``(first byte, past the last byte, data pointer)`` per root, as :func:`_spans` gives
    them) share a byte: the same array twice, or two views of one allocation that overlap (empty spans share
    nothing)."""
    end = None
    for first, past, _ in sorted(span for span in spans if span[1] > span[0]):
        if end is not None and first < end:
            return True
        end = past if end is None else max(end, past)
    return False


def _root_of(ptr: int, spans: Sequence[Tuple[int, int, int]]) -> Optional[Tuple[int, int]]:
    """``(root index, offset from the root's data pointer)`` of the root whose bytes hold address ``ptr`` (roots that
    share no byte: at most one does), or None."""
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
        roots: the call's per-call arrays (CuPy or CUDA-array-interface), any strides, no two sharing a byte
            (:meth:`RecordedCalls.run` records no call whose roots do).
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
_SHARED_ROOTS = object()  # a call whose roots share bytes: it ran its path, and its key's next call records
_WORDS = frozenset((type(None), bool, int, float, str))  # scalar arguments, kept in the key as (type, value)
_NONE_WORD = (type(None), None)  # None's word, made once (an absent array: the commonest scalar)
_EMPTY_WORD = (tuple, 0)  # an empty tuple's word, made once
Pointers = Mapping[type, Callable[[Any], int]]  # per array type, its data pointer (no Python call: attrgetter)
_scalars: Dict[type, bool] = {}  # per argument type seen, whether it is a scalar's (types are few and long-lived)
# FixedArguments.word: per distinct words read (the arguments' key words), its number (a key word that hashes and
# compares at once; a number drawn from a counter, never from the table's size: two threads may add words at once)
_FIXED_NUMBERS: Dict[Tuple[Any, ...], int] = {}
_NEXT_FIXED = itertools.count()


class FixedArguments:
    """Arguments of recorded calls that are the same objects for the life of their holder (a handle's arrays and
    options: immutable, held by the handle, so their shapes, strides and data pointers cannot change), read once by
    :func:`call_key` itself: ``word``, one key word standing for every word of ``args`` (the number of those words
    among those seen), and ``roots`` and ``pointers``, the arrays among ``args`` and their data pointers. A recorded
    call given one appends these in one step, as if ``args`` were walked there; its path reads ``args``.

    Args:
        args: the arguments (arrays, scalars, tuples of those, objects with a ``launch_key``, other
            ``FixedArguments``), each the very object the path's launches take, none a per-call array.
        pointers: per array type, its data pointer (as :func:`call_key` takes them).
    """

    __slots__ = ("args", "word", "roots", "pointers")

    def __init__(self, args: Tuple[Any, ...], pointers: Pointers):
        key, roots, at = call_key(FixedArguments, args, pointers)
        self.args = args
        self.word = (FixedArguments, _FIXED_NUMBERS.setdefault(key, next(_NEXT_FIXED)))
        self.roots, self.pointers = tuple(roots), tuple(at)


def arguments(given: Any) -> Any:
    """What a path reads of an argument that may come as a :class:`FixedArguments` (its ``args``) or as it is."""
    return given.args if type(given) is FixedArguments else given


def _learn_scalar(kind: type) -> bool:
    """Whether :func:`call_key` keeps an argument of type ``kind`` as a scalar (None, bool, int, float, str, a NumPy
    scalar or dtype), kept in ``_scalars`` (call_key reads it there: a type not seen yet comes here once)."""
    scalar = _scalars[kind] = kind in _WORDS or issubclass(kind, (np.generic, np.dtype))
    return scalar


def refuse_made_per_call(path: Callable[..., None]) -> None:
    """TypeError where ``path`` is a partial, a lambda or a nested function: one made per call, whose key
    (:func:`call_key`) would never be found again (:meth:`RecordedCalls.run` asks at a key's first call: such a
    path's every call is one)."""
    if "<locals>" in getattr(path, "__qualname__", "<locals>"):
        raise TypeError(f"recorded call {path!r}: a partial, lambda or nested function is new at every call (its key "
                        "would never be found again): give a function or bound method and its arguments")


def call_key(path: Callable[..., Any], args: Sequence[Any], pointers: Pointers) -> Tuple[tuple, List[Any], List[int]]:
    """``(key, roots, root pointers)`` of the call ``path(stream, *args)``, read in one pass over ``args``
    (``docs/design.md``, "Recorded calls", states the rule): the key is ``path`` and, per argument in order, an
    array's shape, byte strides, dtype and data pointer modulo 16 (the array is a root); a scalar (None, bool, int,
    float, str, NumPy scalar or dtype) with its type; a tuple's type and length, its items following; an object's
    ``launch_key`` (a hashable value holding every word its launches take from it, no per-call array; a tuple subclass
    with one, such as a NamedTuple of options, is such an object: one word, its items not walked); a
    :class:`FixedArguments`' ``word``, its roots and their pointers as it read them (one step for every item of its
    ``args``). Anything else raises TypeError: its words would not be in the key. A ``path`` made per call (a partial,
    a lambda, a nested function), whose key would never be found again, is refused by :meth:`RecordedCalls.run` at its
    key's first call (:func:`refuse_made_per_call`), not here: a key found was made by a path that passed.

    Args:
        path: the call's launches (through ``Kernels``), a function or a bound method whose owner's state its
            launches read is fixed for the owner's life.
        args: ``path``'s arguments after the stream.
        pointers: per array type the calls take, its data pointer (``CupyDevice.array_pointers``); any other array
            is read through ``param_blocks.array_fields`` (CuPy-like or ``__cuda_array_interface__``).
    """
    words: List[Any] = [path]
    roots: List[Any] = []
    at: List[int] = []
    pending = [*args]
    for a in pending:  # one loop, no frame per argument: a tuple's items are appended to it, and read in turn
        if a is None:
            words.append(_NONE_WORD)
            continue
        kind = type(a)
        if kind is FixedArguments:
            words.append(a.word)
            roots += a.roots
            at += a.pointers
            continue
        pointer = pointers.get(kind)
        if pointer is not None:
            ptr = pointer(a)
            words.append((a.shape, a.strides, a.dtype, ptr & 15))
        elif kind is tuple:
            if a:
                words.append((kind, len(a)))
                pending += a
            else:
                words.append(_EMPTY_WORD)  # no bias terms, say
            continue
        else:
            scalar = _scalars.get(kind)
            if scalar or (scalar is None and _learn_scalar(kind)):
                words.append((kind, a))
                continue
            value = getattr(a, "launch_key", None)  # a NamedTuple may be one key word
            if value is not None:
                words.append((kind, value))
                continue
            if isinstance(a, tuple):
                words.append((kind, len(a)))
                pending += a
                continue
            described = _array(a)
            if described is None:
                raise TypeError(f"recorded call {getattr(path, '__qualname__', path)}: argument {a!r} of type "
                                f"{kind.__name__} gives no launch words: a recorded call takes arrays, scalars, "
                                "tuples of those, objects with a launch_key and FixedArguments (docs/design.md, "
                                "'Recorded calls')")
            ptr, shape, strides, _ = described[0]
            words.append((shape, strides, a.dtype, ptr & 15))
        roots.append(a)
        at.append(ptr)
    return tuple(words), roots, at


class RecordedCalls:
    """The recorded calls of one owner (a backend's Kernels), by call key (:func:`call_key`).

    Args:
        enabled: False (the CUDA simulator, ``EP_COMM_NUMBA_LAUNCH=1``): every call runs its path, nothing is
            recorded.
        allocations: ``held -> context`` in which every allocation through the array module is appended to
            ``held`` (``CupyDevice.allocations_into``), or None: a call that allocates outside its roots is then
            not detected.
        pointers: per array type the calls take, its data pointer (:func:`call_key`).
    """

    def __init__(self, enabled: bool, allocations: Optional[Callable[[List[Any]], Any]] = None,
                 pointers: Optional[Pointers] = None):
        self.enabled = enabled
        self._allocations = allocations
        self._pointers = pointers or {}
        self._calls: Dict[Hashable, Any] = {}
        self.built = 0  # calls recorded so far (a first call at a new key records one)

    def run(self, on: int, path: Callable[..., None], stream: Any, *args: Any) -> None:
        """The call ``path(stream, *args)`` (its launches through ``Kernels``, on ``stream``): the call recorded for
        its key (:func:`call_key`) launched again on stream ``on`` with its roots' pointers; the first call of a key
        runs it and records it (unless two of its roots share bytes: then it only runs, and the key's next call
        records).

        Args:
            on: the driver handle of ``stream``.
            path: the call's launches; every array they take is an argument (a root), a view of one, or long-lived
                (held by the recorded call). One made per call (a partial, lambda or nested function) raises
                TypeError (:func:`refuse_made_per_call`).
            stream: the stream ``path`` launches on (not in the key).
            args: ``path``'s arguments after the stream: arrays, scalars, tuples of those, objects with a
                ``launch_key``, :class:`FixedArguments`.
        """
        if not self.enabled:
            refuse_made_per_call(path)
            path(stream, *args)
            return
        key, roots, pointers = call_key(path, args, self._pointers)
        recorded = self._calls.get(key)
        if recorded is None:
            refuse_made_per_call(path)
            recorded = self._record(roots, path, (stream, *args))
            if recorded is not _SHARED_ROOTS:
                self._calls[key] = recorded
        elif recorded is _UNRECORDABLE:
            path(stream, *args)
        else:
            recorded(on, pointers)

    def launch_counts(self) -> Dict[Hashable, Optional[int]]:
        """Per call key seen, the launches of its recorded call (None: its calls cannot be recorded)."""
        return {key: None if recorded is _UNRECORDABLE else len(recorded) for key, recorded in self._calls.items()}

    def _record(self, roots: Sequence[Any], path: Callable[..., None], args: tuple) -> Any:
        """Run ``path(*args)`` recording its launches; its recorded call, or ``_UNRECORDABLE``; ``_SHARED_ROOTS``
        (nothing recorded) where two roots share bytes: a launch's array inside both could be bound to either, and a
        later call whose roots are apart would replay it from the wrong one (``docs/design.md``, "Recorded calls")."""
        if spans_overlap(_spans(roots)):
            path(*args)
            return _SHARED_ROOTS
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
