"""What every part of the mpi backend is given (``MpiContext``): this rank, the geometry, the symmetric layout, the
topology, the MPI window, the step runner and the scale-out row counts; and the blocks of rows and meta rows a step
puts into and reads from the windows in the symmetric layout (``ep_comm.contract.symmetric``).

Shapes: ``T`` tokens of this rank, ``H`` hidden, ``K`` top-k width, ``R`` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from ep_comm.backends.mpi.steps import MpiStepRunner
from ep_comm.contract import layout as lay
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import SymmetricLayout
from ep_comm.contract.topology import Topology
from ep_comm.handle import EPHandle
from ep_comm.transport.mpi_window import MpiWindow


@dataclass(frozen=True)
class MpiContext:
    """One mpi Buffer on one rank, as its protocol and routes see it. ``scaleout_rows``: the payload rows this rank
    has put into ranks of other nodes so far (forwarders' inboxes included), per operation (``"dispatch"``,
    ``"combine"``); the parts add to it."""

    rank: int
    geo: Geometry
    sym: SymmetricLayout
    topology: Topology
    window: MpiWindow
    runner: MpiStepRunner
    scaleout_rows: Dict[str, int]

    def count_scaleout(self, what: str, dst: int, rows: int) -> None:
        """Count ``rows`` put by operation ``what`` into ``dst``'s window when ``dst`` is in another node."""
        if not self.topology.in_reach(self.rank, dst):
            self.scaleout_rows[what] += rows

    def pack_rows(self, rows: np.ndarray) -> np.ndarray:
        """``[n, H]`` payload -> ``[n, row_bytes]`` uint8 (padded to the symmetric row pitch)."""
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.shape[1] * rows.dtype.itemsize)
        if raw.shape[1] == self.sym.row_bytes:
            return raw
        padded = np.zeros((len(rows), self.sym.row_bytes), dtype=np.uint8)
        padded[:, : raw.shape[1]] = raw
        return padded

    def pack_meta(self, tokens: np.ndarray, local_ids: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
        """``[n, 1+2K]`` int32 meta rows: source token, K expert ids (local, or global on a forwarded route), K float32
        weights as bits. Any negative id ("no expert", int32 or int64, whatever its value) is written as -1: an int64
        id cast to int32 keeps only its low word (INT64_MIN would read as expert 0)."""
        k = self.geo.num_topk
        meta = np.zeros((len(tokens), self.sym.meta_words), dtype=np.int32)
        meta[:, 0] = tokens
        meta[:, 1 : 1 + k] = np.maximum(local_ids, -1)
        if weights is not None:
            meta[:, 1 + k :] = np.ascontiguousarray(weights, dtype=np.float32).view(np.int32)
        return meta

    def put_block(self, dst: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        """Rows ``[n, W]`` payload and meta rows ``[n, 1+2K]`` int32 into ``dst``'s region ``[parity][this rank]``."""
        self.window.put(self.pack_rows(rows), dst, self.sym.row_at(parity, self.rank))
        self.window.put(meta, dst, self.sym.meta_at(parity, self.rank))

    def unpack_rows(self, raw: np.ndarray, width: int) -> np.ndarray:
        """``[n, row_bytes]`` uint8 (or its flat bytes) -> ``[n, width]`` payload (a copy; ``width`` is H, or
        narrower for packed FP8 rows): :meth:`pack_rows` undone."""
        rows = raw.reshape(-1, self.sym.row_bytes)[:, : width * self.geo.dtype.itemsize]
        return np.ascontiguousarray(rows).view(self.geo.dtype).reshape(-1, width)

    def read_block(self, parity: int, src: int, count: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
        """Rows ``[count, width]`` (payload dtype; ``width`` is H, or narrower for packed FP8 rows) and meta
        ``[count, 1+2K]`` int32 that ``src`` wrote here."""
        rows = self.unpack_rows(self.window.local(self.sym.row_at(parity, src), count * self.sym.row_bytes), width)
        meta = self.window.local(self.sym.meta_at(parity, src), count * self.sym.meta_words * 4)
        return rows, meta.view(np.int32).reshape(count, self.sym.meta_words).copy()

    def slots_from_handle(self, handle: EPHandle) -> np.ndarray:
        """int64 ``[T, R]`` slots recorded in a handle's ``dst_buffer_slot_idx`` (-1: the token is not in the rank)."""
        geo = self.geo
        slots = np.full((handle.num_tokens, geo.num_ranks), -1, dtype=np.int64)
        ranks = lay.entry_ranks(handle.topk_idx, geo.experts_per_rank)
        t, k = np.nonzero(handle.dst_buffer_slot_idx >= 0)
        slots[t, ranks[t, k]] = handle.dst_buffer_slot_idx[t, k] - self.rank * geo.max_tokens
        return slots
