"""The prepared path of the nvshmem backend: an eager call of a shape seen before, with a few attribute reads in front
of its launches.

The first call of a shape (per Buffer, operation and call shape: token count, payload shape, options) takes the
general path (``Buffer`` checks every argument, ``NvshmemBackend`` runs the step, recording its calls); when it
returns, a :class:`_Entry` is kept for the shape: its options, the layout of its one output allocation and of its
count block (``device.recarving``: every array carved with ``ndarray(memptr=...)``, no slicing), and the *identity*
of the inputs that were validated (type, shape, dtype, strides, 16-byte alignment, GPU; :func:`identity`). A later
call of the shape whose inputs have that identity skips what the identity proves (the argument checks, the request
objects, the contiguity copies, the views) and runs the same steps, the general path's step functions
(``NvshmemDispatch.new_send``/``new_receive``, ``replay_send``/``replay_receive``,
``NvshmemCombine.send_steps``/``receive_steps``) around one signal-and-wait launch: the same recorded calls,
launched again with its pointers (``RecordedCalls.run``; in the CUDA simulator the same ``Kernels`` calls), the same
poll. Everything else takes the general path (``docs/design.md``, "The eager path", names the conditions).

Never skipped: the capture check (``CapturePolicy.begin``), the routing verdict of a captured dispatch
(``raise_for_checks``), the step numbering and its abort record on failure (``Steps.run``), the routing verdicts on
the device (checked by the count kernel, raised after the poll or by the next call). A call that finds a deferred
verdict to check, a rank missing or an abort record seen takes the general path, which raises them.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from ep_comm.backends.collective_steps import STEP_KINDS
from ep_comm.backends.nvshmem.combine import NvshmemCombine
from ep_comm.backends.nvshmem.dispatch import CopyOptions, NvshmemDispatch, RoutingPlan, host_counts
from ep_comm.backends.nvshmem.routing_roots import COUNT_ROOT, HANDLE_ROOTS
from ep_comm.backends.nvshmem.steps import NvshmemContext, launch_now
from ep_comm.contract.arrays import Array, as_float32
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle, HandleChecks

_MAX_ENTRIES = 64  # shapes kept per Buffer (a full table is cleared: the next call of each shape rebuilds)
# exact output shapes of cpu_sync=True calls kept per entry (cleared when full), and those whose pieces (the receive
# copy, a compact replay's scatter: each exact shape's grid and array shapes are its own) are recorded per Buffer;
# past that many, those pieces launch pre-bound
_MAX_EXACT, _MAX_EXACT_COPIES = 256, 256
# a compact new routing with cpu_sync=True returns views of worst-case outputs (its copy enqueued before the poll)
# only where those take at most this many bytes (decode shapes); larger ones (R * max_tokens rows at prefill, many
# ranks) allocate the exact outputs after the poll, as the general path does
_VIEWS_MAX_BYTES = 64 << 20
_DISPATCH, _COMBINE = STEP_KINDS["dispatch"], STEP_KINDS["combine"]
_FLOAT32 = np.dtype(np.float32)  # NumPy's one float32 dtype (CuPy arrays' too): compared by identity

Identity = Tuple[Any, ...]


def _bytes(shapes: Any) -> int:
    """The bytes of arrays of ``(shape, dtype)`` ``shapes``."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in shapes)


def identity(a: Any, placement: Callable[[Any], Tuple[int, Any]]) -> Identity:
    """What the argument checks of an input array depend on: ``(type, shape, dtype, strides, data pointer modulo 16,
    GPU)`` (``placement``: the device's ``(pointer, GPU)`` of an array)."""
    ptr, gpu = placement(a)
    return type(a), a.shape, a.dtype, a.strides, ptr % 16, gpu


def pair_identity(x: Tuple[Any, Any], placement: Callable[[Any], Tuple[int, Any]]) -> Identity:
    """:func:`identity` of a dispatch's payload given as the FP8 pair ``x``: ``(x_fp8's, scales')``."""
    return identity(x[0], placement), identity(x[1], placement)


class Unprepared:
    """The prepared path's answer to a call it does not take: ``Buffer`` runs its general path, then hands the output
    and this answer to ``PreparedCalls.learn_dispatch`` (``learn_combine``). ``key``: the call shape to learn (None:
    nothing to learn), ``inputs``: the caller's arrays the entry is learnt from."""

    __slots__ = ("key", "inputs")

    def __init__(self, key: Optional[tuple], inputs: tuple = ()):
        self.key, self.inputs = key, inputs


NOT_PREPARED = Unprepared(None)  # a call whose shape is not to be learnt


class _Entry:
    """The prepared path of one call shape: the identities its inputs must have, its carvings and options (set by the
    builders of :class:`PreparedCalls`)."""

    __slots__ = ("inputs", "count", "plan", "outputs", "scratch", "options", "weighted", "exact")

    def __init__(self, inputs: Tuple[Optional[Identity], ...], count: Any, outputs: Any, scratch: Optional[Array],
                 options: Optional[CopyOptions], weighted: bool, plan: Optional[RoutingPlan] = None):
        self.inputs = inputs
        # a new routing: the count block's recarving (the block and the count words its signal sends,
        # NvshmemDispatch.count_carvings) and its receive steps' plan; None otherwise
        self.count, self.plan = count, plan
        self.outputs = outputs  # the outputs' recarving (worst-case shapes), or None (exact outputs)
        self.scratch = scratch  # the weights the kernels write when none were given, or None
        self.options = options  # a dispatch's receive copy's (its weighted is the entry's), None for a combine
        self.weighted = weighted
        # (received rows, expanded rows) -> (recarving, recorded or not, scratch weights) of cpu_sync=True calls
        self.exact: Dict[Tuple[int, int], tuple] = {}


class PreparedCalls:
    """The prepared paths of one ``NvshmemBackend``, by call shape; ``Buffer`` offers each eager call here first.
    They run the pieces of the backend's ``dispatcher`` and ``combiner`` over its context ``ctx``, on the caller's
    stream (taken once per call and passed to every piece), numbered by its step runner (``ctx.runner``).

    :meth:`dispatch` and :meth:`combine` take the caller's arguments as they are (unchecked) and answer
    :class:`Unprepared` for a call they do not take; ``Buffer`` then runs its general path and hands its output to
    :meth:`learn_dispatch` (:meth:`learn_combine`), which keeps an entry for the first call of a shape they prepare."""

    def __init__(self, ctx: NvshmemContext, dispatcher: NvshmemDispatch, combiner: NvshmemCombine):
        self._ctx, self._runner, self._dispatcher, self._combiner = ctx, ctx.runner, dispatcher, combiner
        self._ndarray = ctx.xp.ndarray
        self._placement = ctx.device.placement
        self._entries: Dict[tuple, _Entry] = {}
        self._exact_copies: set = set()  # the exact shapes whose pieces are recorded (at most _MAX_EXACT_COPIES)
        self.replayed = 0  # calls that took the prepared path (tests count them)

    # ----------------------------------------------------------------- dispatch
    def dispatch(self, checked: HandleChecks, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, expand: Any,
                 alignment: Any, zero_padding: Any, cpu_sync: Any, use_fp8: Any) -> Union[DispatchOutput, Unprepared]:
        """``Buffer.dispatch`` without ``stats`` or a hook: prepared when its shape was seen with inputs of the same
        identity, else :class:`Unprepared`. ``x``: ``[T, H]`` (quantized by the scatter where ``use_fp8`` is True) or
        the FP8 pair ``(x_fp8, scales)`` as a tuple; an FP8 call's ``recv_x`` is the packed rows (``Buffer`` unpacks
        them, as its general path does)."""
        key = self._dispatch_key(x, topk_idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync,
                                 use_fp8)
        entry = None if key is None else self._entries.get(key)
        if entry is None:
            return NOT_PREPARED if key is None else Unprepared(key, (x, topk_idx, topk_weights, use_fp8))
        if handle is not None:
            checked.check(handle, "an earlier dispatch")
        place = self._placement
        if ((identity(x, place) if type(x) is not tuple else pair_identity(x, place)) != entry.inputs[0]
                or (handle is None and identity(topk_idx, place) != entry.inputs[1])
                or (topk_weights is not None and identity(topk_weights, place) != entry.inputs[2])
                or not self._enter("dispatch", cpu_sync)):
            return NOT_PREPARED
        if topk_weights is not None:  # the handle's own copy (C-contiguous: learnt so, then the same strides)
            topk_weights = (self._ctx.device.copy(topk_weights) if topk_weights.dtype is _FLOAT32
                            else as_float32(self._ctx.xp, topk_weights, copy=True))
        if use_fp8 or type(x) is tuple:  # the arrays the scatter reads, as they are (learnt so: no copy is made)
            x = self._dispatcher.pack_fp8(x)
        body = self._dispatch_new if handle is None else self._dispatch_cached
        out = self._runner.steps.run("dispatch", False, body, entry, x, topk_idx, topk_weights, handle, cpu_sync)
        checked.note(out.handle)
        self.replayed += 1
        return out

    def _dispatch_key(self, x: Any, idx: Any, weights: Any, handle: Any, expand: Any, alignment: Any,
                      zero_padding: Any, cpu_sync: Any, use_fp8: Any) -> Optional[tuple]:
        """The shape key of a dispatch the prepared path may take (read from attributes only after the types were
        seen), or None."""
        nd = self._ndarray
        if type(cpu_sync) is not bool or type(use_fp8) is not bool or (weights is not None
                                                                       and type(weights) is not nd):
            return None
        if type(x) is nd:
            payload: Any = x.shape
        elif type(x) is tuple and len(x) == 2 and type(x[0]) is nd and type(x[1]) is nd and not use_fp8:
            payload = (x[0].shape, x[1].shape)  # the FP8 pair
        else:
            return None
        weights_shape = None if weights is None else weights.shape
        if handle is None:
            if (type(idx) is not nd or type(expand) is not bool or type(zero_padding) is not bool
                    or type(alignment) is not int):
                return None
            return "new", idx.shape, payload, use_fp8, weights_shape, expand, alignment, zero_padding, cpu_sync
        # a cpu_sync=True replay of a cpu_sync=False handle reads its counts from the device: the general path's
        if idx is not None or type(handle) is not EPHandle or (cpu_sync and not handle.cpu_sync):
            return None
        return ("cached", payload, use_fp8, weights_shape, handle.topk_weights is None, handle.num_tokens,
                handle.expand, handle.expert_alignment, handle.zero_padding, handle.topk_idx.dtype, cpu_sync)

    def learn_dispatch(self, answer: Unprepared, out: DispatchOutput) -> None:
        """After the general path's dispatch gave ``out`` for a call this path ``answer``-ed, keep its entry where its
        shape may be prepared."""
        if answer.key is not None:
            x, idx, weights, use_fp8 = answer.inputs
            fp8 = use_fp8 or type(x) is tuple
            rows, more = (x[0], (x[1],)) if type(x) is tuple else (x, ())
            if self._may_learn(rows, (idx, weights) + more, idx):
                self._learn_dispatch(answer.key, x, self._dispatcher.pack_fp8(x) if fp8 else x, idx, weights, out)

    def _may_learn(self, rows: Any, inputs: Tuple[Any, ...], ids: Any) -> bool:
        """Whether the call just made may be prepared: no profiling, no capture, payload ``rows`` that the kernels
        read in place (``NvshmemContext.kernel_rows``: the prepared path makes no copy), C-contiguous ``inputs``
        (None: not given), signed ``ids`` (None: a replay or a combine). A full table is cleared first."""
        runner = self._runner
        if runner.profile.enabled or runner.capture.active:
            return False
        if len(self._entries) >= _MAX_ENTRIES:
            self._entries.clear()
        return (self._ctx.kernel_rows(rows) and all(a is None or a.flags.c_contiguous for a in inputs)
                and (ids is None or ids.dtype.kind == "i"))

    def _learn_dispatch(self, key: tuple, x: Any, payload: Any, idx: Optional[Array], weights: Optional[Array],
                        out: DispatchOutput) -> None:
        """Keep the entry of a dispatch's shape after its general call of ``x`` (``payload``: what its scatter read,
        ``x`` or its ``Fp8Rows``) gave ``out``."""
        dispatcher, h = self._dispatcher, out.handle
        place = self._placement
        inputs = (pair_identity(x, place) if type(x) is tuple else identity(x, place),
                  None if idx is None else identity(idx, place), None if weights is None else identity(weights, place))
        weighted = h.topk_weights is not None
        new = idx is not None
        outputs, scratch = None, None
        shapes = dispatcher.output_shapes(payload.shape[1], h.expand, h.expert_alignment, weighted, None)
        if not h.cpu_sync or (new and not h.expand and _bytes(shapes) <= _VIEWS_MAX_BYTES):
            arrays, block = dispatcher.carve_outputs(shapes)  # worst-case outputs
            outputs = dispatcher.output_carving(block, arrays, weighted)
            scratch = None if weighted else arrays[2]
        options = dispatcher.receive_options(h.expand, h.expert_alignment, h.zero_padding, new, weighted,
                                             new and dispatcher.counts_in_copy(h.expand, outputs is not None))
        count, plan = None, None
        if new:
            count, views = dispatcher.count_carvings(h.num_tokens, idx.dtype, not h.cpu_sync)
            plan = RoutingPlan(options, views)
        self._entries[key] = _Entry(inputs, count, outputs, scratch, options, weighted, plan)

    def _enter(self, what: str, host_wait: bool) -> bool:
        """Start step ``what`` as the general path does (``StepRunner.collective``): the capture check, then the
        routing verdict of a captured dispatch, then the deferred verdict of a ``cpu_sync=False`` new routing (each
        raised as there). False (nothing enqueued yet) where the general path must take the call: a capture, an unusable
        buffer, a rank missing or an abort record seen."""
        runner = self._runner
        capture = runner.capture
        capture.begin(what, host_wait)
        if capture.active or runner.steps.unusable:
            return False
        capture.raise_for_checks()
        if runner.unchecked is not None:
            runner.raise_unchecked()
        missing, seen = self._ctx.transport.wait_state()
        return not (missing or seen)

    def _exact_outputs(self, entry: _Entry, width: int, on: Any, num_recv: int, num_expanded: int) -> tuple:
        """``(carving, block, launch, scratch)``: a new output block of the exact shapes of ``exact`` (received
        rows, expanded rows) for a ``cpu_sync=True`` call of ``entry``, the recarving kept per shape that carves its
        outputs (``arranged_outputs(carving.views(block), entry.weighted, scratch)``: made when the call needs them,
        a new routing's after its receive copy is launched), and how the pieces whose launches depend on that shape (a
        compact replay's scatter, which writes this rank's own rows into ``recv_x``; the receive copy: its grid and
        array shapes) are launched (a ``Launch``): recorded calls on stream ``on``, but past ``_MAX_EXACT_COPIES``
        shapes pre-bound. Kept per entry (``width``, the payload's, is the entry's): a known shape costs one lookup of
        its two row counts and one allocation, all that runs between a poll and the copy."""
        exact = (num_recv, num_expanded)
        held = entry.exact.get(exact)
        if held is None:
            held, block = self._new_exact_outputs(entry, width, exact)
        else:
            block = held[0].block()
        carving, recorded, scratch = held
        return carving, block, functools.partial(self._runner.recorded.run, on) if recorded else launch_now, scratch

    def _new_exact_outputs(self, entry: _Entry, width: int, exact: Tuple[int, int]) -> tuple:
        """``((carving, recorded, scratch), block)``: :meth:`_exact_outputs` of a shape not kept yet, now kept."""
        dispatcher = self._dispatcher
        options = entry.options
        shapes = dispatcher.output_shapes(width, options.expand, options.alignment, options.weighted, exact)
        arrays, block = dispatcher.carve_outputs(shapes)
        if len(entry.exact) >= _MAX_EXACT:
            entry.exact.clear()
        shape = (options, entry.count is None, width, exact)
        held = entry.exact[exact] = (dispatcher.output_carving(block, arrays, options.weighted),
                                     self._may_record(shape), None if options.weighted else arrays[2])
        return held, block

    def _may_record(self, shape: tuple) -> bool:
        """Whether the pieces of exact output ``shape`` are recorded: False when ``_MAX_EXACT_COPIES`` such shapes
        were recorded already (recorded calls are kept for good: their number is bounded here)."""
        if shape not in self._exact_copies:
            if len(self._exact_copies) >= _MAX_EXACT_COPIES:
                return False
            self._exact_copies.add(shape)
        return True

    def _dispatch_new(self, seq: int, entry: _Entry, x: Any, idx: Array, weights: Optional[Array], handle: None,
                      cpu_sync: bool) -> DispatchOutput:
        """A dispatch of a new routing, the steps of ``NvshmemDispatch.new_send`` and ``new_receive`` around one signal
        and wait. Before the first launch one allocation and one view (the count block and its count words: every
        recorded call takes the whole block as its root). ``cpu_sync`` compact: the copy into the entry's worst-case
        outputs is enqueued before the poll, the outputs are views of the exact rows; ``cpu_sync`` expand (and compact
        past ``_VIEWS_MAX_BYTES``): exact outputs after the poll (carved as kept per shape, their copy recorded per
        shape); else the recorded copy into worst-case outputs."""
        dispatcher = self._dispatcher
        stream, on = self._ctx.device.launch_streams()  # the caller's, for the launches and for the recorded calls
        launch = functools.partial(self._runner.recorded.run, on)
        block, (words,) = entry.count.new()
        dispatcher.new_send(launch, stream, idx, x, weights, block)
        self._ctx.transport.exchange(stream, _DISPATCH, self._runner.timeout_s, words)
        worst = None if entry.outputs is None else (entry.outputs, entry.outputs.block(), entry.scratch)
        return dispatcher.new_receive(launch, stream, block, entry.plan, weights, cpu_sync, worst,
                                      functools.partial(self._exact_outputs, entry, x.shape[1], on))

    def _dispatch_cached(self, seq: int, entry: _Entry, x: Any, idx: None, weights: Optional[Array], h: EPHandle,
                         cpu_sync: bool) -> DispatchOutput:
        """A replay of handle ``h``, the steps of ``NvshmemDispatch.replay_send`` and ``replay_receive`` around one
        signal and wait, into the entry's output block (worst-case shapes; ``cpu_sync``: the exact shapes the handle
        gives, their pieces recorded per shape up to ``_MAX_EXACT_COPIES``). No poll, ``cpu_sync`` or not: the handle
        gave every count (``docs/design.md``, "The eager path"); the outcome of the wait is the next call's to
        raise."""
        dispatcher = self._dispatcher
        stream, on = self._ctx.device.launch_streams()  # the caller's, for the launches and for the recorded calls
        weights = h.topk_weights if weights is None else weights
        if cpu_sync:
            num_recv, num_expanded, aligned = host_counts(h)
            carving, out_block, launch, scratch = self._exact_outputs(entry, x.shape[1], on, num_recv, num_expanded)
        else:
            held = h.derived.get("device_counts")  # dispatcher.device_counts', kept with the handle (not captured)
            num_recv, num_expanded, aligned = held or dispatcher.device_counts(h)
            carving, out_block, scratch = entry.outputs, entry.outputs.block(), entry.scratch
            launch = functools.partial(self._runner.recorded.run, on)
        outputs = (carving, out_block, scratch)
        # an expand replay's scatter does not depend on the exact shape: recorded whatever the shape
        send = functools.partial(self._runner.recorded.run, on) if entry.options.expand else launch
        made = dispatcher.replay_send(send, stream, x, h, weights, outputs, entry.weighted)
        self._ctx.transport.exchange(stream, _DISPATCH, self._runner.timeout_s, None)
        arrays = dispatcher.replay_receive(launch, stream, outputs, entry.options, made)
        received = (h.psum_num_recv_tokens_per_rank, h.psum_num_recv_tokens_per_expert, aligned,
                    h.num_unaligned_recv_tokens_per_expert, num_recv, num_expanded)
        routing = (h.topk_idx, h.is_token_in_rank, h.dst_buffer_slot_idx)
        return dispatcher.output(entry.options, arrays, received, routing, weights, cpu_sync, h.derived.get(COUNT_ROOT),
                                 h.derived.get(HANDLE_ROOTS))

    # ------------------------------------------------------------------ combine
    def combine(self, checked: HandleChecks, y: Any, handle: Any, weights: Any) -> Union[CombineOutput, Unprepared]:
        """``Buffer.combine`` without bias or a hook: prepared when its shape was seen with a ``y`` and ``topk_weights``
        ``weights`` (or None) of the same identity and ``handle`` passed the handle check, else
        :class:`Unprepared`."""
        nd = self._ndarray
        if type(y) is not nd or type(handle) is not EPHandle or (weights is not None and type(weights) is not nd):
            return NOT_PREPARED
        key = (y.shape, handle.num_out_rows, handle.num_tokens, handle.expand, handle.topk_idx.dtype,
               None if weights is None else weights.shape)
        entry = self._entries.get(key)
        if entry is None:
            return Unprepared(key, (y, weights, handle))
        checked.check(handle, "dispatch")
        place = self._placement
        if (identity(y, place) != entry.inputs[0]
                or (weights is not None and identity(weights, place) != entry.inputs[1])
                or not self._enter("combine", handle.cpu_sync)):
            return NOT_PREPARED
        out = self._runner.steps.run("combine", False, self._combine, entry, y, handle, weights)
        self.replayed += 1
        return out

    def learn_combine(self, answer: Unprepared, out: CombineOutput) -> None:
        """After the general path's combine for a call this path ``answer``-ed, keep its entry where its shape may be
        prepared: float32 weights only (the general path takes others through a conversion, which this one skips)."""
        if answer.key is not None:
            y, weights, handle = answer.inputs
            if self._may_learn(y, (weights,), None) and (weights is None or weights.dtype == np.float32):
                self._learn_combine(answer.key, y, weights, handle)

    def _learn_combine(self, key: tuple, y: Array, weights: Optional[Array], h: EPHandle) -> None:
        """Keep the entry of a combine's shape (no bias; float32 ``weights`` or None) after its general call."""
        device, weighted = self._ctx.device, weights is not None
        arrays, block = device.carve(self._combiner.combine_shapes(h, weighted))
        inputs = (identity(y, self._placement), None if weights is None else identity(weights, self._placement))
        self._entries[key] = _Entry(inputs, None, device.recarving(block, arrays), None, None, weighted)

    def _combine(self, seq: int, entry: _Entry, y: Array, h: EPHandle, weights: Optional[Array]) -> CombineOutput:
        """A combine, the steps of ``NvshmemCombine.send_steps`` and ``receive_steps`` around one signal and wait, the
        reduce into the entry's outputs."""
        combiner = self._combiner
        stream, on = self._ctx.device.launch_streams()  # the caller's, for the launches and for the recorded calls
        launch = functools.partial(self._runner.recorded.run, on)
        routing = combiner.send_steps(launch, stream, h, y, weights)
        self._ctx.transport.exchange(stream, _COMBINE, self._runner.timeout_s, None)
        _, outputs = entry.outputs.new()
        return combiner.receive_steps(launch, stream, h, routing, y, outputs[0],
                                      outputs[1] if entry.weighted else None, ())
