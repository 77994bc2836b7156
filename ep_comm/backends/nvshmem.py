"""The ``nvshmem`` backend: the dispatch/combine protocol on GPUs over the NVSHMEM symmetric heap.

Same protocol and results as the ``mpi`` backend (``ep_comm/backends/mpi.py``), bit for bit in
deterministic mode. The data path is ``ep_comm.launching.kernels.Kernels``; per dispatch on rank ``me``:

1. ``count`` (new routing): per-rank/per-expert counts, ``is_token_in_rank``, slot cursors;
2. ``scatter``: each (token, destination) row and meta row straight into region ``[parity][me]``
   of the destination's symmetric buffer (stores through peer views; with ``use_puts`` into a
   local staging block that ``nvshmem_puts.put_blocks`` sends);
3. signal ``step_word(seq, kind)`` to every rank, carrying this rank's per-destination counts (new
   routing), then a bounded GPU wait for every rank's signal (``gpu_copy``);
4. ``receive_count`` (new routing) and ``receive_copy`` into the outputs.

Every step's signal advances the device step counter (``ep_comm.kernels.step_counter``): the kernels read
the step number and buffer parity from it, not from the host (the senders, before the signal, one
step ahead). The launches of a step are therefore the same at every step, and the ``cpu_sync=False``
calls (a dispatch of a new routing or of a handle, a combine) can be captured into a CUDA graph and
replayed, with peer stores (the puts path computes its offsets on the host and refuses capture).

Combine runs ``combine_send`` back into the sources' buffers (plus the weights' return route when
weights are given, ``weight_return``), signal + wait, then ``combine_reduce`` with the bias.

Everything is enqueued on the caller's current CuPy stream (Numba launches through
``cuda.external_stream``), with Numba's CUDA-array-interface stream sync off during our launches:
every array we pass was made on, or handed in for, that same stream. The host waits only where
``cpu_sync=True`` needs it: a dispatch reads its row counts (one synchronisation), a combine
reports a timeout. With ``cpu_sync=False`` nothing waits on the host: outputs have the contract's
worst-case rows, the true counts stay on the device, and a timeout is reported by the next call.

``EP_COMM_PROFILE=1``: per-phase host time (perf_counter) and GPU time (CUDA events); every rank
prints its medians when the buffer closes (ranks differ: a rank's wait includes its peers' lag).

Inputs: CuPy arrays, or any GPU array with DLPack / ``__cuda_array_interface__`` (PyTorch
tensors, zero copy). Outputs: CuPy arrays.
"""
from __future__ import annotations

import contextlib
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import layout as lay
from ..handle import CombineOutput, DispatchOutput, EPHandle
from ..symmetric import SymmetricLayout
from ..validate import Geometry, check_num_sms_fits
from .steps import STEP_KINDS, Steps, step_word

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types the backend accepts
PROFILE_ENV = "EP_COMM_PROFILE"


def _import_gpu_stack():
    """CuPy and nvshmem4py, or a RuntimeError that says what is missing."""
    try:
        import cupy
        import nvshmem.core  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"backend='nvshmem' needs CuPy and nvshmem4py ({exc}); use backend='mpi' on CPU") from exc
    return cupy


def staging_bytes(sym: SymmetricLayout) -> int:
    """Bytes of the puts staging area: ``2R - 1`` blocks of ``max_tokens`` rows and meta rows (see
    ``NvshmemTransport``)."""
    blocks = 2 * sym.num_ranks - 1
    return blocks * sym.max_tokens * (sym.row_bytes + 4 * sym.meta_words)


def staged_destinations(rows_stage, meta_stage, num_ranks: int) -> Tuple[tuple, tuple]:
    """Per-destination views for the kernels in puts mode, as tuples of ``[1, R, max_tokens, ...]``.

    ``rows_stage``/``meta_stage`` are ``[2R - 1, max_tokens, ...]`` blocks. The view of destination
    ``r`` starts at block ``r``, so the row a kernel writes at ``[0, me, slot]`` lands in block
    ``r + me``: each destination gets its own contiguous block, which ``put_blocks`` sends whole.
    """
    def view(stage, r: int):
        return stage[r: r + num_ranks].reshape((1,) + (num_ranks,) + tuple(stage.shape[1:]))

    return (tuple(view(rows_stage, r) for r in range(num_ranks)),
            tuple(view(meta_stage, r) for r in range(num_ranks)))


BLOCKS_PER_SM = 2  # blocks of the unit-cut kernels (count, scatter, receive count/place) per SM
STREAM_BLOCKS_PER_SM = 8  # blocks of the row-streaming kernels (receive rows, combine) per SM


def device_sm_count(cp, device: int) -> int:
    """The number of SMs (``MultiProcessorCount``) of CUDA device ``device``, e.g. 132 on an H200."""
    return int(cp.cuda.Device(device).attributes["MultiProcessorCount"])


def sms_in_effect(comm: MPI.Comm, num_sms: Optional[int], device_sms: int) -> int:
    """The SM count the kernels use on this rank: ``num_sms``, or ``device_sms`` (this rank's GPU) for None.

    Collective: every rank learns every rank's SM count, so a ``num_sms`` above any rank's raises
    the same ValueError (naming ``num_sms``, the value and the fewest SMs) on every rank.
    """
    check_num_sms_fits(num_sms, comm.allgather(int(device_sms)))
    return device_sms if num_sms is None else int(num_sms)


def grid_shape(num_sms: int) -> Dict[str, int]:
    """``Kernels`` launch shape for ``num_sms`` SMs: ``num_blocks = 2 * num_sms`` (unit-cut kernels) and
    ``stream_blocks = 8 * num_sms`` (row-streaming kernels); 132 SMs (H200) give 264 / 1056."""
    return dict(num_blocks=BLOCKS_PER_SM * num_sms, stream_blocks=STREAM_BLOCKS_PER_SM * num_sms)


class NvshmemTransport:
    """How bytes reach the peers: stores through NVSHMEM peer views, or staging + NVSHMEM puts.

    ``rows``/``meta``: per-rank destination views for the kernels (Numba device arrays, made once);
    ``step``: the device step counter (int64 ``[1]``); ``send_step`` and ``send_ahead``: where the
    sending kernels take their parity from, ``step[0] + 1`` (they run before the signal that advances
    the counter), or a constant 0 with puts (the staging area has one half).
    """

    def __init__(self, comm: MPI.Comm, sym: SymmetricLayout, word: np.dtype, use_puts: Optional[bool]):
        import cupy

        from ..launching.views import symmetric_views
        from ..transport import gpu_copy
        from ..transport.nvshmem_heap import PUTS_ENV, NvshmemHeap, env_flag

        self._gpu_copy = gpu_copy
        self.use_puts = env_flag(PUTS_ENV) if use_puts is None else bool(use_puts)
        self.sym = sym
        extra = staging_bytes(sym) if self.use_puts else 0
        self.heap = NvshmemHeap(comm, sym.total_bytes + extra, self.use_puts)
        self.rank, self.device = self.heap.rank, self.heap.device
        self.status = gpu_copy.WaitStatus(sym.num_ranks, self.device)
        self.step = cupy.zeros(1, dtype=cupy.int64)
        self.send_step = cupy.zeros(1, dtype=cupy.int64) if self.use_puts else self.step
        self.send_ahead = 0 if self.use_puts else 1
        dev = _numba_view
        self.own = symmetric_views(self.heap.local, sym, word)
        if self.use_puts:
            r, t = sym.num_ranks, sym.max_tokens
            rows_bytes = (2 * r - 1) * t * sym.row_bytes
            stage = self.heap.local[sym.total_bytes: sym.total_bytes + staging_bytes(sym)]
            self._stage_rows = dev(stage[:rows_bytes])
            self._stage_meta = dev(stage[rows_bytes:])
            self._sym = dev(self.heap.local)
            rows, meta = staged_destinations(stage[:rows_bytes].view(word).reshape(2 * r - 1, t, -1),
                                             stage[rows_bytes:].view(cupy.int32).reshape(2 * r - 1, t, -1), r)
        else:
            peers = [symmetric_views(p, sym, word) for p in self.heap.peers]
            rows, meta = tuple(v.rows for v in peers), tuple(v.meta for v in peers)
        self.rows = tuple(dev(v) for v in rows)
        self.meta = tuple(dev(v) for v in meta)

    def flush(self, stream, parity: int, psum, with_meta: bool) -> None:
        """Puts only: send each destination ``r`` its staged ``psum[r] - psum[r-1]`` rows (and meta rows)."""
        if not self.use_puts:
            return
        from ..transport import nvshmem_puts

        sym, me = self.sym, self.rank
        nvshmem_puts.put_blocks(stream, self._stage_rows, me, sym.max_tokens * sym.row_bytes, self._sym,
                                sym.row_at(parity, me), sym.row_bytes, psum)
        if with_meta:
            meta_bytes = 4 * sym.meta_words
            nvshmem_puts.put_blocks(stream, self._stage_meta, me, sym.max_tokens * meta_bytes, self._sym,
                                    sym.meta_at(parity, me), meta_bytes, psum)

    def signal(self, stream, seq: int, what: str, counts=None) -> None:
        """Advance the device step counter, then ``signal[me] = step_word(step, what)`` in every rank,
        after ``counts`` (int32 ``[R]``) went to their count words of the step's parity. Peer stores
        read the step from the device counter; puts use the host's ``seq`` (equal to it: the puts path
        is never captured into a graph)."""
        sym, me = self.sym, self.rank
        if self.use_puts:
            from ..transport import nvshmem_puts

            self._gpu_copy.advance_step(self.step)
            nvshmem_puts.signal_peers(stream, _numba_view(self.own.signal), sym.num_ranks, me, step_word(seq, what),
                                      None if counts is None else _numba_view(counts),
                                      _numba_view(self.own.counts[seq % 2]))
        else:
            self._gpu_copy.signal_peers(self.heap.peer_ptrs, sym.num_ranks, me, sym.signal_offset, self.step,
                                        STEP_KINDS[what], counts, sym.counts_offset)

    def wait(self, what: str, timeout_s: float, with_counts: bool) -> None:
        """Enqueue the bounded wait for every rank's signal of this step; with ``with_counts`` the
        received count words of missing ranks are zeroed."""
        self._gpu_copy.wait_signals(self.own.signal, self.sym.num_ranks, self.step, STEP_KINDS[what], timeout_s,
                                    self.status.device, self.own.counts if with_counts else None)

    def missing_ranks(self) -> List[int]:
        return self.status.read().missing_ranks

    def close(self, collective: bool) -> None:
        self.heap.close(collective=collective)


def _numba_view(a):
    """Zero-copy Numba device array of a CuPy array, without the interface's stream sync."""
    from numba import cuda

    return cuda.as_cuda_array(a, sync=False)


class CupyDevice:
    """The host's handle on the GPU: the caller's stream, launch settings, one-sync reads."""

    def __init__(self, cp, num_local: int):
        self._cp = cp
        self._streams: Dict[int, Any] = {}
        self._pinned = cp.cuda.alloc_pinned_memory(4 * (2 + num_local))
        self._host = np.frombuffer(self._pinned, dtype=np.int32, count=2 + num_local)

    def stream(self):
        """The Numba stream of the current CuPy stream (0: the legacy default stream)."""
        ptr = self._cp.cuda.get_current_stream().ptr
        if ptr == 0:
            return 0
        if ptr not in self._streams:
            from numba import cuda

            self._streams[ptr] = cuda.external_stream(ptr)
        return self._streams[ptr]

    @contextmanager
    def launching(self) -> Iterator[None]:
        """Numba skips the CUDA-array-interface stream sync while we launch on the caller's stream."""
        from numba.cuda.core import config

        saved = config.CUDA_ARRAY_INTERFACE_SYNC
        config.CUDA_ARRAY_INTERFACE_SYNC = 0
        try:
            yield
        finally:
            config.CUDA_ARRAY_INTERFACE_SYNC = saved

    def synchronize(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()

    def mapped_int64(self, count: int, fill: int) -> tuple:
        """``(host, device)`` views of ``count`` int64 words of device-mapped pinned memory (``gpu_copy``)."""
        from ..transport.gpu_copy import mapped_int64

        return mapped_int64(count, fill=fill)

    @contextmanager
    def allocations_into(self, held: List[Any]) -> Iterator[None]:
        """Every CuPy allocation made inside is also appended to ``held`` (through the current allocator)."""
        cp = self._cp
        allocate = cp.cuda.get_allocator()

        def holding(size: int):
            memory = allocate(size)
            held.append(memory)
            return memory

        with cp.cuda.using_allocator(holding):
            yield

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph (the legacy stream never is)."""
        ptr = self._cp.cuda.get_current_stream().ptr
        return ptr != 0 and self._cp.cuda.runtime.streamIsCapturing(ptr) != 0

    def read_int32(self, totals, per_expert) -> Tuple[np.ndarray, np.ndarray]:
        """Host copies of int32 ``totals [2]`` and ``per_expert [L]``: two async copies, one synchronisation."""
        cp = self._cp
        stream = cp.cuda.get_current_stream()
        host_ptr = self._pinned.ptr
        for a, offset in ((totals, 0), (per_expert, 8)):
            if a.size:
                cp.cuda.runtime.memcpyAsync(host_ptr + offset, a.data.ptr, a.nbytes, 2, stream.ptr)  # device to host
        stream.synchronize()
        return self._host[:2].copy(), self._host[2: 2 + per_expert.size].copy()

    def event(self):
        event = self._cp.cuda.Event()
        event.record()
        return event

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return float(self._cp.cuda.get_elapsed_time(start, end)) / 1e3


class Profile:
    """Opt-in per-phase timings: host seconds (perf_counter) and GPU seconds (events, when ``device`` has them)."""

    def __init__(self, enabled: bool, device: Any):
        self.enabled = enabled
        self._device = device
        self._records: List[tuple] = []
        self._off = contextlib.nullcontext()

    def phase(self, op: str, name: str):
        """A context that times one phase (a no-op when profiling is off)."""
        return self._timed(op, name) if self.enabled else self._off

    @contextmanager
    def _timed(self, op: str, name: str) -> Iterator[None]:
        start_event = self._device.event()
        start = time.perf_counter()
        yield
        self._records.append((op, name, time.perf_counter() - start, start_event, self._device.event()))

    def report(self) -> str:
        """Median host and GPU microseconds per (operation, phase), in first-seen order."""
        table: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
        for op, name, host_s, start, end in self._records:
            gpu_s = self._device.elapsed_s(start, end) if start is not None else float("nan")
            table.setdefault((op, name), []).append((host_s, gpu_s))
        lines = [f"{'op':<9}{'phase':<16}{'calls':>6}{'host us p50':>13}{'gpu us p50':>12}"]
        for (op, name), samples in table.items():
            host, gpu = np.median(np.asarray(samples), axis=0) * 1e6
            lines.append(f"{op:<9}{name:<16}{len(samples):>6}{host:>13.1f}{gpu:>12.1f}")
        return "\n".join(lines)


class NvshmemBackend:
    """GPU backend. Arrays in: CuPy / DLPack / ``__cuda_array_interface__``; arrays out: CuPy."""

    name = "nvshmem"

    def __init__(self, comm: MPI.Comm, geo: Geometry, deterministic: bool, timeout_s: float,
                 use_puts: Optional[bool] = None, num_sms: Optional[int] = None):
        """``num_sms``: SMs the kernels' grids are sized for (None: all of the device's; see :func:`grid_shape`)."""
        cp = _import_gpu_stack()
        from ..launching.views import word_dtype

        comm = comm.Dup()
        sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize)
        transport = NvshmemTransport(comm, sym, word_dtype(geo.hidden, geo.dtype.itemsize), use_puts)
        try:
            self.num_sms = sms_in_effect(comm, num_sms, device_sm_count(cp, transport.device))
        except ValueError:  # raised on every rank alike: the collective release cannot hang
            transport.close(collective=True)
            comm.Free()
            raise
        self._setup(comm, geo, deterministic, timeout_s, cp, transport, CupyDevice(cp, geo.experts_per_rank),
                    grid_shape(self.num_sms))

    def _setup(self, comm: MPI.Comm, geo: Geometry, deterministic: bool, timeout_s: float, xp, transport, device,
               launch: Dict[str, int]) -> None:
        """State shared by every construction path; ``launch``: ``Kernels`` launch-shape overrides."""
        from ..launching.kernels import Kernels

        self._cp = xp
        self.comm, self.rank, self.geo = comm, comm.rank, geo
        self.deterministic, self.timeout_s = deterministic, timeout_s
        self.sym = transport.sym
        self.transport, self.device = transport, device
        self.kernels = Kernels(xp, num_ranks=geo.num_ranks, num_experts=geo.num_experts, num_topk=geo.num_topk,
                               max_tokens=geo.max_tokens, **launch)
        own = transport.own
        self._own_rows = _device_array(xp, own.rows)
        self._own_meta = _device_array(xp, own.meta)
        self._own_counts = _device_array(xp, own.counts)
        self._scratch = xp.empty(0, dtype=np.float32)  # weight outputs nobody asked for
        self._capturing = False  # the current call is being captured into a CUDA graph
        self._held: List[Any] = []  # memory captured calls allocated: graph replays use it
        # routing checks of captured dispatches, [largest id, a repeated row], read after their replays
        self._captured_checks_host, self._captured_checks = device.mapped_int64(2, fill=-1)
        self.profile = Profile(os.environ.get(PROFILE_ENV, "") == "1", device)
        self.steps = Steps(self.rank, timeout_s)

    @property
    def xp(self):
        """The array module of this backend (CuPy)."""
        return self._cp

    # ------------------------------------------------------------------ inputs
    def as_array(self, obj, name: str):
        """A CuPy view of GPU array ``obj`` (zero copy); host arrays raise TypeError naming ``name``."""
        cp = self._cp
        if isinstance(obj, cp.ndarray):
            return self._on_my_gpu(obj, name)
        on_gpu = (int(obj.__dlpack_device__()[0]) in (_DL_CUDA, _DL_CUDA_MANAGED)
                  if hasattr(obj, "__dlpack_device__") else hasattr(obj, "__cuda_array_interface__"))
        if on_gpu:
            return self._on_my_gpu(cp.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cp.asarray(obj), name)
        if hasattr(obj, "__dlpack__") or hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
            raise TypeError(f"{name} is a host array ({type(obj).__name__}): the nvshmem backend takes GPU arrays "
                            "(CuPy, PyTorch CUDA tensors, anything with __cuda_array_interface__ or DLPack)")
        raise TypeError(f"{name} must be a GPU array, got {type(obj).__name__}")

    def _on_my_gpu(self, a, name: str):
        """``a`` if it lives on this rank's GPU; ValueError naming ``name`` and both GPUs otherwise."""
        mine = getattr(self.transport, "device", None)
        where = getattr(getattr(a, "device", None), "id", mine)
        if mine is not None and where != mine:
            raise ValueError(f"{name} is on GPU {where}: this rank's Buffer works on GPU {mine} "
                             "(each rank's arrays must live on its own GPU)")
        return a

    def routing_summary(self, topk_idx) -> Tuple[int, int]:
        """``(largest id, first row naming an expert twice or -1)`` of a non-empty integer routing
        (``validate.check_topk_idx``): one kernel and one read for signed ids, CuPy code for unsigned.

        Under CUDA graph capture nothing can be read back: the check kernel folds its result into a
        record that the first call after the replays reads (:meth:`_raise_for_captured_checks`), and
        ``(-1, -1)`` ("nothing wrong yet") is returned. The kernels read ids past the experts as "no
        expert" meanwhile (``ep_comm.kernels.routing``)."""
        from ..host import to_host
        from ..validate import topk_values

        signed = np.issubdtype(np.dtype(topk_idx.dtype), np.signedinteger)
        if self.device.capturing():
            if not signed:
                raise RuntimeError(f"topk_idx has dtype {topk_idx.dtype}: a dispatch captured into a CUDA graph "
                                   "needs signed expert ids (int32 or int64), whose check runs on the device")
            with self._launching():
                self.kernels.check_routing(topk_idx, into=self._captured_checks)
            return -1, -1
        self._raise_for_captured_checks()
        if not signed:
            return topk_values(self._cp, topk_idx)
        with self._launching():
            top, twice = to_host(self.kernels.check_routing(topk_idx)).tolist()
        return int(top), int(twice)

    def dispatch_layout(self, topk_idx) -> lay.DispatchLayout:
        """``ep_comm.layout.dispatch_layout`` by the count kernel (no host synchronisation)."""
        with self._launching():
            send = self.kernels.count(topk_idx, stable=False)
        return lay.DispatchLayout(send.num_tokens_per_rank, send.num_tokens_per_expert, send.is_token_in_rank)

    # ---------------------------------------------------------------- protocol
    @contextmanager
    def _launching(self) -> Iterator[None]:
        """Kernels launch on the caller's current stream, without interface syncs."""
        self.kernels.stream = self.device.stream()
        with self.device.launching():
            yield

    @contextmanager
    def _collective(self, what: str, host_wait: bool) -> Iterator[int]:
        """The next collective step's host number ``seq``, on the caller's stream, after raising any
        timeout an earlier asynchronous wait recorded (the step's signal advances the device counter).
        ``host_wait``: the step waits on the host (cpu_sync), which a graph capture cannot hold."""
        self._capturing = self.device.capturing()
        self._refuse_capture(what, host_wait)
        if not self._capturing and what != "close":
            self._raise_for_captured_checks()
        if not self.steps.unusable:
            self._raise_if_timed_out("an earlier operation", self.steps.seq)
        with self.steps.collective(what) as (seq, _), self.profile.phase(what, "total"), self._launching():
            yield seq

    def _refuse_capture(self, what: str, host_wait: bool) -> None:
        """RuntimeError, before the step enqueues anything (the buffer stays usable), when the caller's stream is
        being captured into a CUDA graph and this step cannot be: it waits on the host, or the puts
        transport computes its offsets from the host's step number (a replay would reuse them)."""
        if not self._capturing:
            return
        why = ("it waits on the host (cpu_sync=True, or a combine of a cpu_sync=True dispatch's handle)"
               if host_wait else "the puts transport (EP_COMM_NVSHMEM_PUTS=1) takes its buffer offsets from the host"
               if self.transport.use_puts else None)
        if why:
            raise RuntimeError(f"{what} was called while the current stream is being captured into a CUDA graph, "
                               f"and {why}: a capture can hold dispatches with cpu_sync=False (a new routing with "
                               "int32/int64 ids, or handle=...) and the combines of their handles, over peer stores; "
                               "call it outside the capture")

    @contextmanager
    def captured_memory(self) -> Iterator[None]:
        """Around a whole ``Buffer`` call: while the caller's stream is being captured into a CUDA graph,
        every allocation the call makes is held until the Buffer closes (the graph's replays use that
        memory; back in the pool it would be handed out again). A no-op otherwise."""
        if not self.device.capturing():
            yield
            return
        with self.device.allocations_into(self._held):
            yield

    def _contiguous(self, a):
        """``a`` C-contiguous (a copy only when it is not)."""
        return None if a is None else self._cp.ascontiguousarray(a)

    def _raise_for_captured_checks(self) -> None:
        """ValueError naming the bad ``topk_idx`` that a dispatch replayed from a CUDA graph was given,
        once (the record is cleared: the buffer stays usable, the ranks stayed in step). Read without
        a synchronisation: a replay still running is reported by a later call."""
        top, twice = (int(v) for v in self._captured_checks_host)
        if top < self.geo.num_experts and twice < 0:
            return
        self._captured_checks_host[:] = -1
        what = (f"expert id {top} (ids must be < num_experts={self.geo.num_experts})" if top >= self.geo.num_experts
                else f"row {twice} naming the same expert twice")
        raise ValueError(f"a dispatch replayed from a CUDA graph was given a topk_idx holding {what}; its kernels "
                         "read ids past the experts as 'no expert', so that replay's outputs are not what was asked")

    def _raise_if_timed_out(self, what: str, seq: int) -> None:
        """Raise ep_comm.TimeoutError (and mark the buffer unusable) if any wait so far timed out."""
        missing = self.transport.missing_ranks()
        if missing:
            raise self.steps.timed_out(what, seq, missing)

    def _signal_and_wait(self, what: str, seq: int, counts=None) -> None:
        """Signal step ``seq`` to every rank (with this rank's per-destination ``counts``), then enqueue
        the bounded wait for every rank's signal (the received counts of a missing rank become 0).

        The signal word is ``step_word(seq, what)`` (monotone). A peer has arrived when its word equals
        this step's value or reached the next step (a peer is at most one step ahead); a peer in
        another kind of step with the same number (e.g. closing while this rank dispatches) has not."""
        with self.profile.phase(what, "signal+wait"):
            self.transport.signal(self.kernels.stream, seq, what, counts)
            self.transport.wait(what, self.timeout_s, counts is not None)

    def _sync_and_check(self, what: str, seq: int) -> None:
        """Block until the stream is done (bounded by the GPU wait), then raise on a timeout."""
        with self.profile.phase(what, "host sync"):
            self.device.synchronize()
        self._raise_if_timed_out(what, seq)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx, topk_weights, handle: Optional[EPHandle], expand: bool, alignment: int,
                 zero_padding: bool, cpu_sync: bool, stats) -> DispatchOutput:
        with self._collective("dispatch", cpu_sync) as seq:
            if handle is None:
                return self._dispatch_new(seq, x, topk_idx, topk_weights, expand, alignment, zero_padding,
                                          cpu_sync, stats)
            return self._dispatch_cached(seq, x, handle, topk_weights, cpu_sync, stats)

    def _send(self, seq: int, x, topk_idx, topk_weights, slot_idx, mode: int, psum) -> None:
        """Rank scatter of rows and meta rows into every destination (then the puts, if any)."""
        t = self.transport
        with self.profile.phase("dispatch", "scatter"):
            self.kernels.scatter(self._contiguous(x), topk_idx, self._contiguous(topk_weights), slot_idx, t.rows,
                                 t.meta, src_rank=self.rank, step=t.send_step, ahead=t.send_ahead, mode=mode)
            t.flush(self.kernels.stream, seq % 2, psum, with_meta=True)

    def _dispatch_new(self, seq: int, x, topk_idx, topk_weights, expand, alignment, zero_padding, cpu_sync,
                      stats) -> DispatchOutput:
        from ..launching.kernels import PLACE_ATOMIC, PLACE_STABLE, SLOT_ATOMIC, SLOT_STABLE

        k, step = self.kernels, self.transport.step
        with self.profile.phase("dispatch", "count"):
            send = k.count(topk_idx, stable=self.deterministic)
        self._send(seq, x, topk_idx, topk_weights, send.slot_idx,
                   SLOT_STABLE if self.deterministic else SLOT_ATOMIC, send.rank_psum)
        self._signal_and_wait("dispatch", seq, send.num_tokens_per_rank)
        with self.profile.phase("dispatch", "receive_count"):
            recv = k.receive_count(self._own_counts, self._own_meta, step, alignment=alignment,
                                   expand=expand, stable=self.deterministic)
        if stats is not None:
            _add_counts(self._cp, stats, recv.num_unaligned_per_expert)
        if cpu_sync:
            with self.profile.phase("dispatch", "host sync"):
                (num_recv, num_expanded), aligned = self.device.read_int32(recv.totals, recv.num_aligned_per_expert)
            self._raise_if_timed_out("dispatch", seq)
            counts = (int(num_recv), int(num_expanded), [int(c) for c in aligned])
        else:
            counts = (recv.totals[0], recv.totals[1], recv.num_aligned_per_expert)
        outputs = self._receive(recv.rank_psum, recv.expert_psum, None, topk_weights is not None, expand,
                                alignment, zero_padding, cpu_sync, counts[:2],
                                PLACE_STABLE if self.deterministic else PLACE_ATOMIC)
        handle = EPHandle(
            psum_num_recv_tokens_per_rank=recv.rank_psum, psum_num_recv_tokens_per_expert=recv.expert_psum,
            num_recv_tokens_per_expert=counts[2], num_unaligned_recv_tokens_per_expert=recv.num_unaligned_per_expert,
            recv_src_metadata=outputs[3], dst_buffer_slot_idx=send.slot_idx, num_recv_tokens=counts[0],
            num_expanded_tokens=counts[1], num_tokens=int(topk_idx.shape[0]), topk_idx=topk_idx,
            topk_weights=topk_weights, is_token_in_rank=send.is_token_in_rank, expand=expand,
            expert_alignment=alignment, zero_padding=zero_padding, deterministic=self.deterministic,
            cpu_sync=cpu_sync, num_out_rows=int(outputs[0].shape[0]))
        return DispatchOutput(outputs[0], outputs[1], outputs[2], handle)

    def _dispatch_cached(self, seq: int, x, h: EPHandle, topk_weights, cpu_sync, stats) -> DispatchOutput:
        """Replay ``h``'s routing: recorded slots and layout, no counting, no count exchange."""
        from ..launching.kernels import PLACE_CACHED, SLOT_CACHED

        cp = self._cp
        psum = h.psum_num_recv_tokens_per_rank
        send_psum = (cp.cumsum(h.is_token_in_rank.sum(axis=0, dtype=cp.int32), dtype=cp.int32)
                     if self.transport.use_puts else None)
        self._send(seq, x, h.topk_idx, topk_weights, h.dst_buffer_slot_idx, SLOT_CACHED, send_psum)
        self._signal_and_wait("dispatch", seq)
        if stats is not None:
            _add_counts(cp, stats, h.num_unaligned_recv_tokens_per_expert)
        if cpu_sync:
            self._sync_and_check("dispatch", seq)
            counts = (int(h.num_recv_tokens), int(h.num_expanded_tokens), [int(c) for c in _host(h.num_recv_tokens_per_expert)])
        else:
            counts = (psum[-1],) + _device_counts(cp, h)
        outputs = self._receive(psum, h.psum_num_recv_tokens_per_expert, h.recv_src_metadata,
                                topk_weights is not None, h.expand, h.expert_alignment, h.zero_padding, cpu_sync,
                                counts[:2], PLACE_CACHED)
        handle = EPHandle(
            psum_num_recv_tokens_per_rank=psum, psum_num_recv_tokens_per_expert=h.psum_num_recv_tokens_per_expert,
            num_recv_tokens_per_expert=counts[2],
            num_unaligned_recv_tokens_per_expert=h.num_unaligned_recv_tokens_per_expert,
            recv_src_metadata=outputs[3], dst_buffer_slot_idx=h.dst_buffer_slot_idx, num_recv_tokens=counts[0],
            num_expanded_tokens=counts[1], num_tokens=h.num_tokens, topk_idx=h.topk_idx, topk_weights=topk_weights,
            is_token_in_rank=h.is_token_in_rank, expand=h.expand, expert_alignment=h.expert_alignment,
            zero_padding=h.zero_padding, deterministic=self.deterministic, cpu_sync=cpu_sync,
            num_out_rows=int(outputs[0].shape[0]))
        return DispatchOutput(outputs[0], outputs[1], outputs[2], handle)

    def _out_rows(self, cpu_sync: bool, expand: bool, alignment: int, exact: Tuple[Any, Any]) -> Tuple[int, int]:
        """``(metadata rows N_out, recv_x rows)``: exact with ``cpu_sync``, else the contract's worst cases."""
        geo = self.geo
        if cpu_sync:
            n, m = exact
            return n, (m if expand else n)
        n = lay.worst_case_recv_rows(geo.num_ranks, geo.max_tokens)
        if not expand:
            return n, n
        return n, lay.worst_case_expanded_rows(geo.num_ranks, geo.max_tokens, geo.num_topk, geo.experts_per_rank,
                                               alignment)

    def _receive(self, rank_psum, expert_psum, recorded, with_weights: bool, expand: bool,
                 alignment: int, zero_padding: bool, cpu_sync: bool, exact: Tuple[Any, Any], mode: int) -> tuple:
        """Allocate the outputs and copy the received rows into them.

        Returns ``(recv_x [rows, H], recv_topk_idx, recv_topk_weights or None, recv_src_metadata [N_out, 2+K])``;
        ids/weights are ``[N_out, K]`` compact or ``[M_out]`` expand. ``recorded``: the metadata of the
        handle replayed (its expanded rows are reused), or None."""
        cp, geo, k = self._cp, self.geo, self.geo.num_topk
        with self.profile.phase("dispatch", "alloc outputs"):
            n_out, rows = self._out_rows(cpu_sync, expand, alignment, exact)
            ids_shape = (rows,) if expand else (rows, k)
            recv_x = cp.empty((rows, geo.hidden), dtype=geo.dtype)
            recv_idx = cp.empty(ids_shape, dtype=cp.int64)
            recv_w = cp.empty(ids_shape, dtype=cp.float32) if with_weights else self._scratch_weights(ids_shape)
            metadata = cp.empty((n_out, 2 + k), dtype=cp.int32)
            if recorded is not None and expand:
                m = min(n_out, recorded.shape[0])
                metadata[:m] = recorded[:m]
        with self.profile.phase("dispatch", "receive_copy"):
            self.kernels.receive_copy(rank_psum, self._own_rows, self._own_meta, self.transport.step, recv_x, recv_idx,
                                      recv_w, metadata, expand=expand, mode=mode, expert_psum=expert_psum,
                                      alignment=alignment, zero_padding=zero_padding)
        return recv_x, recv_idx, recv_w if with_weights else None, metadata

    def _scratch_weights(self, shape: tuple):
        """A float32 array of ``shape`` for the weights the kernels write when nobody asked for them: one
        reused array, or a new one held for the graph when captured (a later growth of the reused one
        would free it under the graph)."""
        size = int(np.prod(shape))
        if self._capturing:
            return self._cp.empty(shape, dtype=np.float32)
        if self._scratch.size < size:
            self._scratch = self._cp.empty(size, dtype=np.float32)
        return self._scratch[:size].reshape(shape)

    # ----------------------------------------------------------------- combine
    def combine(self, y, handle: EPHandle, topk_weights, bias_terms: Sequence) -> CombineOutput:
        with self._collective("combine", handle.cpu_sync) as seq:
            return self._combine(seq, y, handle, topk_weights, bias_terms)

    def _combine(self, seq: int, y, h: EPHandle, topk_weights, bias_terms) -> CombineOutput:
        from ..launching import weight_return

        cp, geo, t, k = self._cp, self.geo, self.transport, self.kernels
        weights = self._contiguous(topk_weights)
        with self.profile.phase("combine", "send"):
            k.combine_send(self._contiguous(y), h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, t.rows,
                           my_rank=self.rank, step=t.send_step, ahead=t.send_ahead, expand=h.expand,
                           weights=weights if h.expand else None)
            if weights is not None:
                bits = weights.view(cp.int32).reshape(weights.shape[0], weights.shape[1] if weights.ndim == 2 else 1)
                weight_return.send_weights(k.stream, bits, h.expand, h.recv_src_metadata,
                                           h.psum_num_recv_tokens_per_rank, t.meta, my_rank=self.rank,
                                           step=t.send_step, ahead=t.send_ahead, max_blocks=k.num_blocks)
            t.flush(k.stream, seq % 2, h.psum_num_recv_tokens_per_rank, with_meta=weights is not None)
        self._signal_and_wait("combine", seq)
        with self.profile.phase("combine", "reduce"):
            x = cp.empty((h.num_tokens, geo.hidden), dtype=geo.dtype)
            k.combine_reduce(self._own_rows, t.step, h.dst_buffer_slot_idx, h.topk_idx, x, my_rank=self.rank,
                             bias=[_bias_term(cp, b) for b in bias_terms])
            back = None
            if weights is not None:
                back = cp.empty((h.num_tokens, geo.num_topk), dtype=cp.float32)
                weight_return.gather_weights(k.stream, self._own_meta, t.step, h.dst_buffer_slot_idx, h.topk_idx,
                                             back.view(cp.int32), experts_per_rank=geo.experts_per_rank,
                                             my_rank=self.rank, max_blocks=k.num_blocks)
        if h.cpu_sync:
            self._sync_and_check("combine", seq)
        return CombineOutput(x, back)

    # ------------------------------------------------------------------- close
    def close(self) -> None:
        """Collective close with a bounded wait; after a timeout, release local resources only."""
        if self.transport is None:
            return
        clean = False
        try:
            if not self.steps.unusable:
                with self._collective("close", host_wait=True) as seq:
                    self._signal_and_wait("close", seq)
                    self._sync_and_check("close", seq)
                clean = True
        finally:
            self.device.synchronize()
            if self.profile.enabled:
                print(f"[ep_comm profile, rank {self.rank}, nvshmem backend, use_puts={self.transport.use_puts}]\n"
                      f"{self.profile.report()}", flush=True)
            self.transport.close(collective=clean)
            self.transport = None
            self._held.clear()
            if clean:
                self.comm.Free()


def _device_array(xp, a):
    """A kernel argument made once: a Numba device array on the GPU, the array itself in the simulator."""
    return a if xp is np else _numba_view(a)


def _host(values) -> Sequence:
    """A host sequence of a host list or a device array."""
    return values.get() if hasattr(values, "get") else values


def _device_counts(cp, h: EPHandle) -> tuple:
    """``(num_expanded_tokens, num_recv_tokens_per_expert)`` of handle ``h`` as device arrays, for the
    outputs of a ``cpu_sync=False`` replay. A ``cpu_sync=True`` handle holds them as host values: they
    are derived on the device from its unaligned counts (no host-to-device copy, which a CUDA graph
    capture cannot hold): the aligned counts, and their sum (expanded rows, padding included)."""
    if not h.cpu_sync:
        return h.num_expanded_tokens, h.num_recv_tokens_per_expert
    aligned = _align_up(h.num_unaligned_recv_tokens_per_expert.astype(cp.int32), h.expert_alignment)
    return aligned.sum(dtype=cp.int64), aligned


def _align_up(values, alignment: int):
    """``values`` (a new device array, changed in place: no temporaries) rounded up to ``alignment``."""
    if alignment > 1:
        values += alignment - 1
        values //= alignment
        values *= alignment
    return values


def _add_counts(xp, stats, counts) -> None:
    """``stats += counts`` in ``stats``'s dtype, without a temporary (a captured call must not free one)."""
    xp.add(stats, counts, out=stats, casting="unsafe")


def _bias_term(cp, b):
    """A bias term the combine kernel reads: float32/float16/bfloat16 as is, other floats as float32."""
    kind = np.dtype(b.dtype)
    if kind.itemsize == 2 or kind == np.float32:
        return cp.ascontiguousarray(b)
    return cp.ascontiguousarray(b.astype(cp.float32))
