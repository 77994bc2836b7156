"""The ``nvshmem`` backend: the dispatch/combine protocol on GPUs over the NVSHMEM symmetric heap.

Same protocol and results as the ``mpi`` backend (``ep_comm/backends/mpi.py``), bit for bit in
deterministic mode: each operation writes rows, meta rows and (new routings) counts into the
region ``[parity][me]`` of every destination's symmetric buffer, then signals ``seq``; every
rank waits for all signals with a bounded GPU wait, then reads its own buffer.

Everything runs on the caller's current CuPy stream. With ``cpu_sync=False`` nothing waits on
the host: outputs have the contract's worst-case rows and the true counts stay on the device
(a timeout is then reported by the next call). Index arithmetic is vectorised CuPy (no host
round trips); rows move through ``ep_comm.transport`` kernels; combine sums in
``nvshmem_reduce`` in the reference float32 order.

Inputs: CuPy arrays, or any GPU array with DLPack / ``__cuda_array_interface__`` (PyTorch
tensors, zero copy). Outputs: CuPy arrays.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from mpi4py import MPI

from .. import layout as lay
from ..errors import BufferUnusableError, TimeoutError
from ..handle import CombineOutput, DispatchOutput, EPHandle
from ..symmetric import SymmetricLayout
from ..transport import gpu_copy
from ..validate import Geometry
from . import nvshmem_reduce as red

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types the backend accepts
_SIGNAL_KIND = {"dispatch": 1, "combine": 2, "close": 3}


def _import_gpu_stack():
    """CuPy and nvshmem4py, or a RuntimeError that says what is missing."""
    try:
        import cupy
        import nvshmem.core  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"backend='nvshmem' needs CuPy and nvshmem4py ({exc}); use backend='mpi' on CPU") from exc
    return cupy


class NvshmemBackend:
    """GPU backend. Arrays in: CuPy / DLPack / ``__cuda_array_interface__``; arrays out: CuPy."""

    name = "nvshmem"

    def __init__(self, comm: MPI.Comm, geo: Geometry, deterministic: bool, timeout_s: float,
                 use_puts: Optional[bool] = None):
        self._cp = _import_gpu_stack()
        from ..transport.nvshmem_heap import NvshmemHeap

        self.comm = comm.Dup()
        self.rank = self.comm.rank
        self.geo = geo
        self.deterministic = deterministic
        self.timeout_s = timeout_s
        self.sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize)
        self.heap = NvshmemHeap(self.comm, self.sym.total_bytes, use_puts)
        self.status = gpu_copy.WaitStatus(geo.num_ranks, self.heap.device)
        self.signals = self.heap.local[: 8 * geo.num_ranks].view(self._cp.int64)
        self.seq = 0
        self.unusable: Optional[str] = None

    @property
    def xp(self):
        """The array module of this backend (CuPy)."""
        return self._cp

    # ------------------------------------------------------------------ inputs
    def as_array(self, obj, name: str):
        """A CuPy view of GPU array ``obj`` (zero copy); host arrays raise TypeError naming ``name``."""
        cp = self._cp
        if isinstance(obj, cp.ndarray):
            return obj
        on_gpu = (int(obj.__dlpack_device__()[0]) in (_DL_CUDA, _DL_CUDA_MANAGED)
                  if hasattr(obj, "__dlpack_device__") else hasattr(obj, "__cuda_array_interface__"))
        if on_gpu:
            return cp.from_dlpack(obj) if hasattr(obj, "__dlpack__") else cp.asarray(obj)
        if hasattr(obj, "__dlpack__") or hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
            raise TypeError(f"{name} is a host array ({type(obj).__name__}): the nvshmem backend takes GPU arrays "
                            "(CuPy, PyTorch CUDA tensors, anything with __cuda_array_interface__ or DLPack)")
        raise TypeError(f"{name} must be a GPU array, got {type(obj).__name__}")

    def dispatch_layout(self, topk_idx) -> lay.DispatchLayout:
        """``ep_comm.layout.dispatch_layout`` on the device (no host synchronisation)."""
        cp, geo = self._cp, self.geo
        idx = topk_idx.astype(cp.int64)
        in_rank = self._in_rank(self._entry_ranks(idx))
        per_expert = cp.bincount(cp.where(idx >= 0, idx, geo.num_experts).ravel(), minlength=geo.num_experts + 1)
        return lay.DispatchLayout(in_rank.sum(axis=0, dtype=cp.int64).astype(cp.int32),
                                  per_expert[: geo.num_experts].astype(cp.int32), in_rank)

    # ------------------------------------------------------------ routing math
    def _entry_ranks(self, idx):
        """[T, K] int64 destination rank of each entry, -1 where masked."""
        cp = self._cp
        return cp.where(idx >= 0, idx // self.geo.experts_per_rank, -1)

    def _in_rank(self, ranks):
        """[T, R] bool: the token has an entry on rank r."""
        cp = self._cp
        return (ranks[:, :, None] == cp.arange(self.geo.num_ranks)[None, None, :]).any(axis=1)

    def _stable_slots(self, in_rank):
        """[T, R] int64 slot of each (token, rank) pair in ascending token order, -1 where not sent.
        Valid for both modes: the non-deterministic contract allows any order."""
        cp = self._cp
        return cp.where(in_rank, cp.cumsum(in_rank, axis=0, dtype=cp.int64) - 1, -1)

    def _slot_idx(self, ranks, slots):
        """[T, K] int32 ``dst_buffer_slot_idx``: ``me * max_tokens + slot`` on each token's first entry per rank."""
        cp, k = self._cp, self.geo.num_topk
        earlier = cp.tril(cp.ones((k, k), dtype=bool), -1)  # earlier[k, j]: j < k
        repeat = ((ranks[:, :, None] == ranks[:, None, :]) & earlier[None]).any(axis=2)
        first = (ranks >= 0) & ~repeat
        slot = cp.take_along_axis(slots, cp.maximum(ranks, 0), axis=1)
        return cp.where(first, self.rank * self.geo.max_tokens + slot, -1).astype(cp.int32)

    def _slots_from_handle(self, handle: EPHandle):
        """[T, R] int64 slots recorded in ``handle.dst_buffer_slot_idx`` (-1: not sent)."""
        cp, geo = self._cp, self.geo
        t, r = handle.num_tokens, geo.num_ranks
        flat = cp.full(t * r + 1, -1, dtype=cp.int64)
        ranks = self._entry_ranks(handle.topk_idx.astype(cp.int64))
        sent = handle.dst_buffer_slot_idx >= 0
        target = cp.where(sent, cp.arange(t)[:, None] * r + cp.maximum(ranks, 0), t * r)
        flat[target.ravel()] = (handle.dst_buffer_slot_idx.astype(cp.int64) - self.rank * geo.max_tokens).ravel()
        return flat[: t * r].reshape(t, r)

    def _dispatch_meta(self, idx, weights):
        """[T, R, 1+2K] int32 meta row of each (token, destination): token, local ids there, weight bits."""
        cp, geo = self._cp, self.geo
        t, k = idx.shape
        meta = cp.zeros((t, geo.num_ranks, self.sym.meta_words), dtype=cp.int32)
        meta[:, :, 0] = cp.arange(t, dtype=cp.int32)[:, None]
        local = idx[:, None, :] - (cp.arange(geo.num_ranks) * geo.experts_per_rank)[None, :, None]
        on_rank = (idx[:, None, :] >= 0) & (local >= 0) & (local < geo.experts_per_rank)
        meta[:, :, 1 : 1 + k] = cp.where(on_rank, local, -1)
        if weights is not None:
            meta[:, :, 1 + k :] = cp.ascontiguousarray(weights, dtype=cp.float32).view(cp.int32)[:, None, :]
        return meta

    # ---------------------------------------------------------------- protocol
    @contextmanager
    def _collective(self, what: str) -> Iterator[tuple]:
        """Number the next collective step and yield ``(seq, parity)``; a step that fails midway
        leaves the peers out of step, so the buffer is marked unusable (as the mpi backend does)."""
        if self.unusable:
            raise BufferUnusableError(f"rank {self.rank}: cannot {what}: {self.unusable}; close this Buffer and create a new one")
        self._raise_if_timed_out("an earlier operation", self.seq)
        self.seq += 1
        try:
            yield self.seq, self.seq % 2
        except BaseException as exc:
            if not self.unusable:
                self.unusable = f"{what} #{self.seq} failed midway ({type(exc).__name__}: {exc})"
            raise

    def _raise_if_timed_out(self, what: str, seq: int) -> None:
        """Raise ep_comm.TimeoutError (and mark the buffer unusable) if any wait so far timed out."""
        missing = self.status.read().missing_ranks
        if missing:
            self.unusable = f"{what} #{seq} timed out waiting for ranks {missing}"
            raise TimeoutError(
                f"rank {self.rank}: {what} (#{seq}) timed out after {self.timeout_s:g} s waiting for ranks {missing} "
                f"(every rank must call dispatch/combine collectively)", missing)

    def _put(self, src, src_pitch: int, num_pairs: int, fanout: int, dst_rank, dst_row, dst_offset: int,
             dst_pitch: int, row_bytes: int) -> None:
        """``gpu_copy.put_rows`` semantics through peer-view stores or NVSHMEM puts (``use_puts``)."""
        args = (src, src_pitch, num_pairs, fanout, self.geo.num_ranks, dst_rank, dst_row)
        if self.heap.use_puts:
            from ..transport import nvshmem_puts

            nvshmem_puts.put_rows(*args, self.heap.local, dst_offset, dst_pitch, row_bytes)
        else:
            gpu_copy.put_rows(*args, self.heap.peer_ptrs, dst_offset, dst_pitch, row_bytes)

    def _signal_and_wait(self, what: str, seq: int, counts=None) -> None:
        """Signal step ``seq`` to every rank, then enqueue the bounded wait for every rank's signal.

        The signal word is ``4 * seq + kind`` (monotone). A peer has arrived when its word equals
        this step's value or reached the next step (a peer is at most one step ahead); a peer in
        another kind of step with the same number (e.g. closing while this rank dispatches) has not."""
        geo = self.geo
        value = 4 * seq + _SIGNAL_KIND[what]
        if self.heap.use_puts:
            from ..transport import nvshmem_puts

            nvshmem_puts.signal_peers(self.signals, geo.num_ranks, self.rank, value)
        else:
            gpu_copy.signal_peers(self.heap.peer_ptrs, geo.num_ranks, self.rank, self.sym.signal_offset, value)
        gpu_copy.wait_signals(self.signals, geo.num_ranks, value, 4 * (seq + 1), self.timeout_s, self.status.device,
                              counts)

    def _sync_and_check(self, what: str, seq: int) -> None:
        """Block until the stream is done (bounded by the GPU wait), then raise on a timeout."""
        self._cp.cuda.get_current_stream().synchronize()
        self._raise_if_timed_out(what, seq)

    def _region(self, offset: int, nbytes: int):
        """uint8 view of ``nbytes`` of the local symmetric buffer at ``offset``."""
        return self.heap.local[offset : offset + nbytes]

    def _rows_region(self, parity: int):
        geo = self.geo
        return self._region(self.sym.row_at(parity, 0), geo.num_ranks * geo.max_tokens * self.sym.row_bytes)

    def _meta_region(self, parity: int):
        geo = self.geo
        return self._region(self.sym.meta_at(parity, 0), geo.num_ranks * geo.max_tokens * self.sym.meta_words * 4)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx, topk_weights, handle: Optional[EPHandle], expand: bool, alignment: int,
                 zero_padding: bool, cpu_sync: bool, stats) -> DispatchOutput:
        with self._collective("dispatch") as step:
            return self._dispatch(step, x, topk_idx, topk_weights, handle, expand, alignment, zero_padding,
                                  cpu_sync, stats)

    def _dispatch(self, step, x, topk_idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync,
                  stats) -> DispatchOutput:
        cp, geo, sym = self._cp, self.geo, self.sym
        seq, parity = step
        idx = topk_idx.astype(cp.int64)
        if handle is None:
            ranks = self._entry_ranks(idx)
            in_rank = self._in_rank(ranks)
            slots = self._stable_slots(in_rank)
            slot_idx = self._slot_idx(ranks, slots)
        else:
            in_rank, slot_idx = handle.is_token_in_rank, handle.dst_buffer_slot_idx
            slots = self._slots_from_handle(handle)
        num_tokens, nbytes = idx.shape[0], geo.hidden * geo.dtype.itemsize
        pairs, dst_row = num_tokens * geo.num_ranks, cp.ascontiguousarray(slots.ravel())
        self._put(cp.ascontiguousarray(x), nbytes, pairs, geo.num_ranks, None, dst_row, sym.row_at(parity, self.rank),
                  sym.row_bytes, nbytes)
        meta_bytes = 4 * sym.meta_words
        self._put(self._dispatch_meta(idx, topk_weights), meta_bytes, pairs, 1, None, dst_row,
                  sym.meta_at(parity, self.rank), meta_bytes, meta_bytes)
        counts_region = self._region(sym.count_at(parity, 0), 8 * geo.num_ranks).view(cp.int64)
        if handle is None:  # count exchange
            sent = in_rank.sum(axis=0, dtype=cp.int64)
            self._put(sent, 8, geo.num_ranks, 1, None, cp.zeros(geo.num_ranks, dtype=cp.int64),
                      sym.count_at(parity, self.rank), 8, 8)
            self._signal_and_wait("dispatch", seq, counts_region)
            counts = counts_region.copy()
        else:
            self._signal_and_wait("dispatch", seq)
            counts = cp.diff(cp.asarray(handle.psum_num_recv_tokens_per_rank, dtype=cp.int64), prepend=0)
        num_recv = None
        if cpu_sync:
            self._sync_and_check("dispatch", seq)
            num_recv = int(counts.sum())
        return self._receive(parity, counts, num_recv, handle, idx, topk_weights, in_rank, slot_idx, expand,
                             alignment, zero_padding, cpu_sync, stats, topk_idx)

    def _receive(self, parity, counts, num_recv, handle, idx, topk_weights, in_rank, slot_idx, expand, alignment,
                 zero_padding, cpu_sync, stats, topk_idx) -> DispatchOutput:
        """Receiver side: blocks grouped by source rank -> outputs, metadata and the handle."""
        cp, geo, sym = self._cp, self.geo, self.sym
        k, num_local = geo.num_topk, geo.experts_per_rank
        n_out = num_recv if cpu_sync else lay.worst_case_recv_rows(geo.num_ranks, geo.max_tokens)
        psum = cp.cumsum(counts)
        row = cp.arange(n_out, dtype=cp.int64)
        src = cp.searchsorted(psum, row, side="right")
        valid = src < geo.num_ranks
        src = cp.minimum(src, geo.num_ranks - 1)
        sym_row = cp.where(valid, src * geo.max_tokens + row - (psum - counts)[src], -1)
        meta = cp.empty((n_out, sym.meta_words), dtype=cp.int32)
        gpu_copy.gather_rows(self._meta_region(parity), 4 * sym.meta_words, sym_row, meta, 4 * sym.meta_words,
                             4 * sym.meta_words)
        local_ids = cp.where(valid[:, None], meta[:, 1 : 1 + k], -1).astype(cp.int64)
        weights = cp.ascontiguousarray(meta[:, 1 + k :]).view(cp.float32) if topk_weights is not None else None
        if handle is None:
            unaligned, aligned, psum_e, num_expanded, expanded_row = self._expert_layout(local_ids, alignment, expand)
        else:
            expanded_row = self._fit_rows(handle.recv_src_metadata[:, 2:], n_out)
            unaligned = cp.asarray(handle.num_unaligned_recv_tokens_per_expert)
            aligned = cp.asarray(handle.num_recv_tokens_per_expert, dtype=cp.int32)
            psum_e = cp.asarray(handle.psum_num_recv_tokens_per_expert)
            num_expanded = cp.asarray(handle.num_expanded_tokens, dtype=cp.int64)
        if stats is not None:
            stats += unaligned.astype(stats.dtype)
        if expand:
            out_rows = (int(num_expanded) if cpu_sync else
                        lay.worst_case_expanded_rows(geo.num_ranks, geo.max_tokens, k, num_local, alignment))
            recv_x, recv_idx, recv_w = self._expand(parity, sym_row, local_ids, weights, expanded_row, out_rows)
        else:
            out_rows = n_out
            recv_x = self._gather_payload(parity, sym_row)
            recv_idx = local_ids
            recv_w = None if weights is None else cp.where(local_ids >= 0, weights, 0).astype(cp.float32)
        metadata = cp.empty((n_out, 2 + k), dtype=cp.int32)
        metadata[:, 0] = cp.where(valid, src * geo.max_tokens + meta[:, 0], -1)
        metadata[:, 1] = sym_row
        metadata[:, 2:] = expanded_row
        new_handle = EPHandle(
            psum_num_recv_tokens_per_rank=psum.astype(cp.int32),
            psum_num_recv_tokens_per_expert=psum_e,
            num_recv_tokens_per_expert=[int(c) for c in aligned.get()] if cpu_sync else aligned,
            num_unaligned_recv_tokens_per_expert=unaligned,
            recv_src_metadata=metadata,
            dst_buffer_slot_idx=slot_idx,
            num_recv_tokens=num_recv if cpu_sync else psum[-1].copy(),
            num_expanded_tokens=int(num_expanded) if cpu_sync else num_expanded,
            num_tokens=int(idx.shape[0]), topk_idx=topk_idx, topk_weights=topk_weights, is_token_in_rank=in_rank,
            expand=expand, expert_alignment=alignment, zero_padding=zero_padding,
            deterministic=self.deterministic, cpu_sync=cpu_sync, num_out_rows=out_rows,
        )
        return DispatchOutput(recv_x, recv_idx, recv_w, new_handle)

    def _expert_layout(self, local_ids, alignment: int, expand: bool) -> tuple:
        """``ep_comm.layout.receive_layout`` on the device: ``(unaligned, aligned, psum, num_expanded, expanded_row)``
        with int32 ``[L]`` counts, a 0-d int64 ``num_expanded`` and int32 ``[N, K]`` expanded rows."""
        cp, num_local = self._cp, self.geo.experts_per_rank
        hits = (local_ids[:, :, None] == cp.arange(num_local)[None, None, :]).any(axis=1)  # [N, L]
        unaligned = hits.sum(axis=0, dtype=cp.int64)
        aligned = -(-unaligned // alignment) * alignment
        ends = cp.cumsum(aligned)
        starts = ends - aligned
        psum_e = (starts + unaligned) if expand else ends
        if expand:
            rank_in_expert = cp.cumsum(hits, axis=0, dtype=cp.int64) - 1
            expert = cp.maximum(local_ids, 0)
            placed = starts[expert] + cp.take_along_axis(rank_in_expert, expert, axis=1)
            expanded_row = cp.where(local_ids >= 0, placed, -1).astype(cp.int32)
        else:
            expanded_row = cp.full(local_ids.shape, -1, dtype=cp.int32)
        return (unaligned.astype(cp.int32), aligned.astype(cp.int32), psum_e.astype(cp.int32), aligned.sum(),
                expanded_row)

    def _fit_rows(self, rows, n: int):
        """``rows`` cut or padded with -1 to ``n`` rows (a handle replayed with another ``cpu_sync``)."""
        cp = self._cp
        out = cp.full((n, rows.shape[1]), -1, dtype=cp.int32)
        m = min(n, rows.shape[0])
        out[:m] = rows[:m]
        return out

    def _gather_payload(self, parity: int, sym_row):
        """``[len(sym_row), H]`` payload rows of the local receive region (-1: zero row)."""
        cp, geo = self._cp, self.geo
        nbytes = geo.hidden * geo.dtype.itemsize
        out = cp.empty((sym_row.shape[0], geo.hidden), dtype=geo.dtype)
        gpu_copy.gather_rows(self._rows_region(parity), self.sym.row_bytes, sym_row, out, nbytes, nbytes)
        return out

    def _expand(self, parity, sym_row, local_ids, weights, expanded_row, out_rows: int) -> tuple:
        """Expert scatter: one output row per (row, local expert); padding rows are zero."""
        cp, k = self._cp, self.geo.num_topk
        entry = cp.full(out_rows + 1, -1, dtype=cp.int64)  # entry (row * K + k) placed at each expanded row
        target = cp.where(expanded_row >= 0, expanded_row, out_rows).astype(cp.int64).ravel()
        entry[target] = cp.arange(target.shape[0], dtype=cp.int64)
        entry = entry[:out_rows]
        placed = entry >= 0
        pick = cp.maximum(entry, 0)
        recv_x = self._gather_payload(parity, cp.where(placed, sym_row[pick // k], -1))
        recv_idx = cp.where(placed, local_ids.ravel()[pick], -1)
        recv_w = None if weights is None else cp.where(placed, weights.ravel()[pick], 0).astype(cp.float32)
        return recv_x, recv_idx, recv_w

    # ----------------------------------------------------------------- combine
    def combine(self, y, handle: EPHandle, topk_weights, bias_terms: Sequence) -> CombineOutput:
        with self._collective("combine") as step:
            return self._combine(step, y, handle, topk_weights, bias_terms)

    def _combine(self, step, y, handle: EPHandle, topk_weights, bias_terms) -> CombineOutput:
        cp, geo, sym = self._cp, self.geo, self.sym
        seq, parity = step
        meta = handle.recv_src_metadata
        valid = meta[:, 0] >= 0
        dst_rank = cp.where(valid, meta[:, 1] // geo.max_tokens, 0).astype(cp.int32)
        dst_row = cp.where(valid, meta[:, 1] % geo.max_tokens, -1).astype(cp.int64)
        y = cp.ascontiguousarray(y)
        if handle.expand:
            expanded_row = cp.ascontiguousarray(meta[:, 2:])
            partial = cp.empty((meta.shape[0], geo.hidden), dtype=geo.dtype)
            red.expand_partials(y, expanded_row, None if topk_weights is None else cp.ascontiguousarray(topk_weights),
                                partial)
            back_w = (None if topk_weights is None else
                      cp.where(expanded_row >= 0, topk_weights[cp.maximum(expanded_row, 0)], 0))
        else:
            partial, back_w = y, topk_weights
        back = cp.zeros((meta.shape[0], sym.meta_words), dtype=cp.int32)
        back[:, 0] = meta[:, 0] % geo.max_tokens
        back[:, 1 : 1 + geo.num_topk] = -1
        if back_w is not None:
            back[:, 1 + geo.num_topk :] = cp.ascontiguousarray(back_w, dtype=cp.float32).view(cp.int32)
        nbytes, meta_bytes = geo.hidden * geo.dtype.itemsize, 4 * sym.meta_words
        self._put(partial, nbytes, meta.shape[0], 1, dst_rank, dst_row, sym.row_at(parity, self.rank),
                  sym.row_bytes, nbytes)
        self._put(back, meta_bytes, meta.shape[0], 1, dst_rank, dst_row, sym.meta_at(parity, self.rank),
                  meta_bytes, meta_bytes)
        self._signal_and_wait("combine", seq)
        if handle.cpu_sync:
            self._sync_and_check("combine", seq)
        return self._reduce_at_source(handle, parity, topk_weights is not None, bias_terms)

    def _reduce_at_source(self, handle: EPHandle, parity: int, with_weights: bool, bias_terms) -> CombineOutput:
        """Source side: each token's rows from the ranks it reached, summed in rank order (float32)."""
        cp, geo = self._cp, self.geo
        slots = cp.ascontiguousarray(self._slots_from_handle(handle))
        bias = cp.stack([red.to_float32(b) for b in bias_terms]) if bias_terms else None
        x = cp.empty((handle.num_tokens, geo.hidden), dtype=geo.dtype)
        red.combine_reduce(self._rows_region(parity), self.sym.row_bytes, geo.max_tokens, slots, bias, x)
        return CombineOutput(x, self._gather_weights(handle, parity, slots) if with_weights else None)

    def _gather_weights(self, handle: EPHandle, parity: int, slots):
        """``[T, K]`` float32: entry k's weight as sent back by the rank owning its expert; 0 if masked."""
        cp, geo, k = self._cp, self.geo, self.geo.num_topk
        ranks = self._entry_ranks(handle.topk_idx.astype(cp.int64))
        rank = cp.maximum(ranks, 0)
        slot = cp.take_along_axis(slots, rank, axis=1)
        meta = self._meta_region(parity).view(cp.int32).reshape(geo.num_ranks * geo.max_tokens, self.sym.meta_words)
        rows = rank * geo.max_tokens + cp.maximum(slot, 0)
        weights = meta[rows, (1 + k + cp.arange(k))[None, :]].view(cp.float32)
        return cp.where((ranks >= 0) & (slot >= 0), weights, 0).astype(cp.float32)

    # ------------------------------------------------------------------- close
    def close(self) -> None:
        """Collective close with a bounded wait; after a timeout, release local resources only."""
        if self.heap is None:
            return
        clean = False
        try:
            if not self.unusable:
                with self._collective("close") as (seq, _):
                    self._signal_and_wait("close", seq)
                    self._sync_and_check("close", seq)
                clean = True
        finally:
            self._cp.cuda.get_current_stream().synchronize()
            self.heap.close(collective=clean)
            self.heap = None
            if clean:
                self.comm.Free()
