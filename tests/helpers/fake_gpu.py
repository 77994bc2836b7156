"""The fake GPU of the nvshmem backend's host-side tests: a loopback transport (one rank, its own only peer) and a
host device (NumPy arrays, no streams): ``simulated_backend`` runs the backend's real call sequence with the kernels
in the Numba CUDA simulator (or stubbed by the test).

The tests drive it with the requests ``Buffer`` makes (:func:`dispatch`, :func:`combine`), mostly at the small
geometry ``SMALL_GEO`` with the routing ``SMALL_IDX``, and watch its kernel launches with :func:`launch_log`."""
import operator
from collections import Counter
from contextlib import contextmanager, nullcontext

import numpy as np
from mpi4py import MPI

from ep_comm._launcher import prebound
from ep_comm._launcher.recorded_calls import RecordedCalls, call_key, spans_overlap
from ep_comm.backends.interface import BackendSettings, CombineRequest, DispatchRequest
from ep_comm.backends.nvshmem import NvshmemBackend
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import ABORT_WORDS, SymmetricLayout, symmetric_views, word_dtype
from ep_comm.contract.topology import transport_mode
from ep_comm.transport.staging import staged_destination, staging_blocks, staging_bytes
from ep_comm.transport.wait_stats import WAIT_WORDS

SMALL_GEO = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))  # one rank, 6 experts, hidden 12, top-3, 9 tokens
SMALL_IDX = np.array([[0, 1, -1], [2, -1, -1], [4, 5, 3]], np.int64)  # 3 tokens of SMALL_GEO: [T, K] int64
_LAYOUT_NUMBERS: dict = {}  # HostDevice.recarving: per distinct layout, its number (its launch_key)


class LoopbackTransport:
    """``NvshmemTransport`` for one rank on host arrays: the rank is its own only peer, reached through stores, or
    with ``use_puts`` through puts (as ``transport="puts"`` does)."""

    device = None  # no GPU: arrays are not checked for theirs
    forward = None  # one rank: one node, nothing forwarded

    def __init__(self, sym, word, use_puts: bool):
        self.sym, self.rank = sym, 0
        self.puts_to = (0,) if use_puts else ()
        self.mode = transport_mode(self.puts_to, 1, 0)
        self.buffer = np.zeros(sym.total_bytes + (staging_bytes(sym) if use_puts else 0), np.uint8)
        self.own = symmetric_views(self.buffer[: sym.total_bytes], sym, word)
        self.missing = []
        self.step = np.zeros(1, np.int64)
        if use_puts:
            t, blocks = sym.max_tokens, staging_blocks(1)
            stage = self.buffer[sym.total_bytes:]
            rows_bytes = blocks * t * sym.row_bytes
            self.stage_rows = stage[:rows_bytes].view(word).reshape(blocks, t, -1)
            self.stage_meta = stage[rows_bytes:].view(np.int32).reshape(blocks, t, -1)
            self.rows = (staged_destination(self.stage_rows, 0, 1),)
            self.meta = (staged_destination(self.stage_meta, 0, 1),)
        else:
            self.rows, self.meta = (self.own.rows,), (self.own.meta,)
        self.aborts = self.buffer[sym.abort_offset: sym.abort_offset + sym.abort_bytes].view(np.int64).reshape(
            1, ABORT_WORDS)
        self.closed_collectively = None

    def flush(self, stream, psum, with_meta: bool, timed=nullcontext) -> None:
        """What ``put_blocks`` does for one rank: staged block ``parity`` -> region [parity][0], the parity that of
        the step the next signal starts; ``psum()`` called, and ``timed`` entered, only with puts."""
        if self.puts_to:
            n, parity = int(psum()[0]), int(self.step[0] + 1) & 1
            with timed():
                self.own.rows[parity, 0, :n] = self.stage_rows[parity, :n]
                if with_meta:
                    self.own.meta[parity, 0, :n] = self.stage_meta[parity, :n]

    def exchange(self, stream, kind: int, timeout_s: float, counts=None) -> None:
        """Signal, then wait (one launch on peer stores): the rank's own signal is the only one."""
        self.signal(stream, kind, counts)
        self.wait(kind, timeout_s, counts is not None)

    def signal(self, stream, kind: int, counts=None) -> None:
        """The step's signal (and counts) to the rank itself."""
        self.step[0] += 1
        seq = int(self.step[0])
        if counts is not None:
            self.own.counts[seq % 2, 0] = counts[0]
        self.own.signal[0] = seq << 2 | kind

    def wait(self, kind: int, timeout_s: float, with_counts: bool) -> None:
        """The wait for the step the counter holds: the rank's own signal arrived unless it was never sent."""
        seq = int(self.step[0])
        got = int(self.own.signal[0])
        if not (got == seq << 2 | kind or got >= (seq + 1) << 2):
            self.missing = [0]

    def wait_state(self):
        return self.missing, any(self.aborts[:, 0].tolist())

    def wait_table(self):
        """No peer to wait for: one rank's wait statistics stay zero."""
        return np.zeros((1, WAIT_WORDS), np.int64)

    def reset_waits(self) -> None:
        """Nothing measured: nothing to reset."""

    def post_abort(self, record) -> None:
        """The rank is its own only peer: nobody to tell."""

    def abort_table(self):
        return self.aborts

    def close(self, collective: bool) -> None:
        self.closed_collectively = collective


class HostDevice:
    """``CupyDevice`` on the host: no streams, no events, reads are copies."""

    xp = np
    array_pointers = {np.ndarray: operator.attrgetter("ctypes.data")}

    def kernel_array(self, a):
        return a

    def stream(self):
        return 0

    def launching(self):
        return nullcontext()

    _streams = (0, 0)  # (Numba stream, driver stream): the legacy default stream

    def launch_streams(self):
        return self._streams

    capturing_now = False

    def synchronize(self) -> None:
        pass

    def mapped_int64(self, count: int, fill: int):
        words = np.full(count, fill, np.int64)
        return words, words

    @contextmanager
    def allocations_into(self, held):
        held.append("the allocations of a captured call")
        yield

    def capturing(self) -> bool:
        return self.capturing_now

    @staticmethod
    def carve(shapes):
        """``CupyDevice.carve``: one array itself, or every array a view of one block, each on 128 bytes."""
        if len(shapes) == 1:
            array = np.empty(*shapes[0])
            return [array], array
        offsets, total = [], 0
        for shape, dtype in shapes:
            offsets.append(total)
            total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 128) * 128
        block = np.empty(max(total, 1), np.uint8)
        return [np.ndarray(shape, dtype, buffer=block, offset=at) for (shape, dtype), at in zip(shapes, offsets)], block

    class recarving:
        """``cupy_device.Recarving`` on the host."""

        def __init__(self, block, views):
            base = block.__array_interface__["data"][0]
            self._block = (block.shape, block.dtype)
            self._views = tuple((v.shape, v.dtype, v.__array_interface__["data"][0] - base, v.strides) for v in views)
            self._whole = len(views) == 1 and views[0] is block
            # one small int per distinct layout, as production's: the key word hashes and compares at once
            self.launch_key = _LAYOUT_NUMBERS.setdefault((self._block, self._views, self._whole), len(_LAYOUT_NUMBERS))

        def new(self):
            block = np.empty(*self._block)
            return block, [block] if self._whole else self.views(block)

        def block(self):
            return np.empty(*self._block)

        def views(self, block, rows=None):
            if self._whole:
                return [block if rows is None else block[:rows]]
            views = []
            for shape, dtype, at, strides in self._views:
                views.append(np.ndarray(shape if rows is None else (rows, *shape[1:]), dtype, buffer=block, offset=at,
                                        strides=strides))
            return views

    copy = staticmethod(np.array)  # CupyDevice.copy: a new array (a C-contiguous one of a C-contiguous input)

    @staticmethod
    def placement(a):
        """``(data pointer, device)`` of a host array (no device): ``ctypes.data``, as ``__array_interface__`` formats
        a bfloat16 dtype slowly."""
        return a.ctypes.data, None

    def handle(self) -> int:
        return 0

    polls = 0  # progress markers polled (the GPU is done with everything at once here)

    def progress(self):
        return "everything so far"

    def reached(self, marker) -> bool:
        self.polls += 1
        return True

    def event(self):
        return None

    current_stream = 0  # what a mark is taken on: a test sets another to call a hook "on another stream"

    def mark(self):
        self.marks = getattr(self, "marks", 0) + 1
        return self.current_stream, f"event {self.marks}"

    def wait_for(self, mark) -> None:
        if mark[0] != self.current_stream:
            self.waited = getattr(self, "waited", []) + [mark[1]]


class RootCheckingCalls(RecordedCalls):
    """The simulator's recorded calls, in check mode: every call runs its launches (nothing is recorded), and each is
    held to the first call of its key (``recorded_calls.call_key``, read from its arguments as on a GPU). A replay on
    a GPU keeps every word of the first call's parameter blocks but the roots' data pointers, so each later call must
    make the same launches (kernel, grid, block, shared bytes) with the same words: the same scalars; for every array
    argument the same shape, strides and dtype and, inside a root, the same root and byte offset from the root's data
    pointer; outside every root (held as long-lived by a recorded call) the same data pointer. This holds whichever
    path (general or prepared) makes the call. A call whose roots share bytes is held to nothing and sets no layout
    for its key: on a GPU it runs as it is and records nothing (``RecordedCalls.run``); ``shared`` counts them."""

    def __init__(self):
        super().__init__(enabled=False, pointers=HostDevice.array_pointers)
        self.layouts = {}
        self.compared = Counter()  # per function (``__qualname__``), its calls held to an earlier call of their key
        self.shared = Counter()  # per function, its calls whose roots shared bytes (held to nothing, as on a GPU)

    def run(self, on, path, stream, *args):
        key, roots, pointers = call_key(path, args, self._pointers)  # the production lookup: a key it misses shows here
        with prebound.recording() as seen:
            super().run(on, path, stream, *args)
        spans = [_span(r, p) for r, p in zip(roots, pointers)]
        if spans_overlap(spans):  # roots that share bytes: a GPU runs such a call as it is and records none of it
            self.shared[path.__qualname__] += 1
            return
        made = tuple((config, _words(args, spans)) for _, config, args in seen)
        first = self.layouts.setdefault(key, made)
        self.compared[path.__qualname__] += first is not made
        assert made == first, (f"recorded call {key!r}: launches (config, words) {made}, but its first call's were "
                               f"{first}: a replay on a GPU would launch those")


def _pointer(a) -> int:
    return a.__array_interface__["data"][0]


def _span(a, ptr: int) -> tuple:
    """``(first byte, past the last byte, data pointer)`` of a NumPy array, whatever its strides."""
    low = high = 0
    for extent, stride in zip(a.shape, a.strides):
        if extent == 0:
            return ptr, ptr, ptr
        reach = (extent - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return ptr + low, ptr + high + a.itemsize, ptr


def _words(args, spans) -> tuple:
    """What a replay on a GPU keeps of a launch's arguments, in order: scalars as they are; an array as its shape,
    strides and dtype and either ``("root", index, offset)`` or ``("held", pointer)`` (an empty one: no pointer, none
    of its elements is read); tuples item by item. An array not on its elements' size fails at once: a GPU kernel
    reading it faults."""
    words = []
    for a in args:
        if isinstance(a, (bool, int, float, np.generic)):
            words.append(a)
        elif isinstance(a, tuple):
            words.append(_words(a, spans))
        elif isinstance(a, np.ndarray) and a.size == 0:
            words.append((a.shape, a.strides, a.dtype.str, "empty"))  # no element: its pointer is never read
        elif isinstance(a, np.ndarray):
            ptr = _pointer(a)
            assert ptr % a.itemsize == 0, (f"a launch reads {a.dtype} [{a.shape}] at {ptr:#x}, not on its {a.itemsize}-byte "
                                           "elements: a GPU faults (misaligned address)")
            where = next((("root", i, ptr - base) for i, (first, end, base) in enumerate(spans) if first <= ptr < end),
                         ("held", ptr))
            words.append((a.shape, a.strides, a.dtype.str, where))
        else:
            words.append(type(a).__name__)
    return tuple(words)


def simulated_backend(geo, deterministic: bool, use_puts: bool, profile: bool = False, launch=None):
    """An ``NvshmemBackend`` over NumPy arrays: the real call sequence, kernels in the simulator. ``launch``: the
    ``Kernels`` launch shape (default: 2 blocks of 2 warps, what the simulator runs in reasonable time; a test
    whose kernels do not run may give a GPU's, ``nvshmem.grid_shape(132)``)."""
    sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize,
                          geo.experts_per_rank)
    transport = LoopbackTransport(sym, word_dtype(geo.hidden, geo.dtype.itemsize), use_puts)
    settings = BackendSettings(deterministic, 5.0, transport="puts" if use_puts else "stores", profile=profile)
    be = NvshmemBackend(MPI.COMM_SELF.Dup(), geo, settings, transport=transport, device=HostDevice(), num_sms=1,
                        launch=launch or dict(num_blocks=2, warps_per_block=2))
    be.runner.recorded = RootCheckingCalls()
    return be


def simulated_buffer(prepared: bool = True, use_puts: bool = False, profile: bool = False, geo: Geometry = SMALL_GEO):
    """A ``Buffer`` of ``geo`` (one rank; ``SMALL_GEO`` unless given) over the simulated nvshmem backend
    (:func:`simulated_backend`, deterministic); ``prepared=False``: the general path only."""
    import ep_comm.buffer as buffer_module

    backend = simulated_backend(geo, True, use_puts, profile=profile)
    saved, buffer_module.make_backend = buffer_module.make_backend, lambda *args: backend
    try:
        buf = buffer_module.Buffer(MPI.COMM_SELF, num_experts=geo.num_experts, hidden=geo.hidden,
                                   num_topk=geo.num_topk, num_max_tokens_per_rank=geo.max_tokens,
                                   dtype=geo.dtype.name, deterministic=True, backend="mpi", profile=profile)
    finally:
        buffer_module.make_backend = saved
    if not prepared:
        buf._prepared = None
    return buf


def dispatch(be, x, topk_idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync, stats):
    """``be.dispatch`` of the request ``Buffer.dispatch`` makes (a replay sends the handle's routing)."""
    idx = topk_idx if handle is None else handle.topk_idx
    return be.dispatch(DispatchRequest(x, idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync, stats))


def combine(be, y, handle, topk_weights, bias_terms):
    """``be.combine`` of the request ``Buffer.combine`` makes."""
    return be.combine(CombineRequest(y, handle, topk_weights, tuple(bias_terms)))


def eager_replay(expand: bool, seed: int, use_puts: bool = False) -> tuple:
    """``(backend, x, first, eager, eager_sum)``: a simulated backend of ``SMALL_GEO`` (over puts with ``use_puts``),
    3 tokens ``x`` (float32), the dispatch ``first`` of ``SMALL_IDX``, an eager cached ``cpu_sync=False`` replay of
    ``x * 2`` and its combine (what a captured replay must give)."""
    be = simulated_backend(SMALL_GEO, True, use_puts)
    x = np.random.default_rng(seed).standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
    first = dispatch(be, x, SMALL_IDX, None, None, expand, 2, True, True, None)
    eager = dispatch(be, x * 2, None, None, first.handle, expand, 2, True, False, None)
    return be, x, first, eager, combine(be, eager.recv_x, eager.handle, None, ())


def launch_log(monkeypatch) -> list:
    """Every kernel launch's grid and non-array arguments, in order."""
    log, launch = [], prebound.PreboundKernel.__call__

    def recording(self, grid, block, stream, shared_bytes, *args):
        scalars = tuple(a if isinstance(a, (bool, int, float, np.integer, np.floating)) else type(a).__name__
                        for a in args)
        log.append((self.dispatcher.__name__, grid, block, shared_bytes, scalars))
        return launch(self, grid, block, stream, shared_bytes, *args)

    monkeypatch.setattr(prebound.PreboundKernel, "__call__", recording)
    return log
