"""The symmetric buffer on the NVSHMEM symmetric heap (nvshmem4py), bootstrapped from mpi4py.

One NVSHMEM runtime per process: the first ``NvshmemHeap`` picks the GPU (by local rank on the
node, unless ``CUDA_VISIBLE_DEVICES`` left one device), sizes the heap (``NVSHMEM_SYMMETRIC_SIZE``)
and initialises NVSHMEM with a unique id broadcast over the communicator; the runtime is
finalised once, at interpreter exit, and only when no buffer lost step with its peers and no Buffer
of the process failed (``nvshmem_free`` and ``nvshmem_finalize`` are collective: after a timeout they
could hang).

The NVSHMEM world is the communicator of the first heap: later heaps must use a communicator
over the same processes (``nvshmem_malloc`` is collective over all of them).

Each heap holds ``nbytes`` of symmetric memory laid out as ``ep_comm.contract.symmetric.SymmetricLayout``,
a uint8 CuPy view of the local copy, a tuple of uint8 views of every rank's copy (peer views,
``nvshmem_ptr``; None for a rank out of load/store reach). The ranks the transport reaches through
stores must have a peer view; the others get their data through NVSHMEM device puts to the symmetric address.
"""
from __future__ import annotations

import atexit
import os
from typing import List, Optional, Tuple

from mpi4py import MPI

from ep_comm.transport import exit_guard

HEAP_ENV = "NVSHMEM_SYMMETRIC_SIZE"
_HEAP_MARGIN = 64 << 20  # NVSHMEM's own symmetric objects and rounding
_DEFAULT_HEAP = 1 << 30  # NVSHMEM's default heap size


def parse_size(text: str) -> int:
    """Bytes of an NVSHMEM size string: an integer or float with an optional k/m/g/t suffix (powers of 2^10)."""
    value = text.strip()
    scale = 1
    if value and value[-1].lower() in "kmgt":
        scale = 1 << (10 * ("kmgt".index(value[-1].lower()) + 1))
        value = value[:-1]
    try:
        return int(-(-float(value) * scale // 1))
    except ValueError:
        raise ValueError(f"{HEAP_ENV}={text!r}: not a size (a number with an optional k/m/g/t suffix)") from None


def heap_size_for(nbytes: int, env_value: Optional[str]) -> Tuple[int, bool]:
    """``(heap bytes, whether to export it)`` for a first buffer of ``nbytes``.

    A size the user exported is kept and must hold the buffer; otherwise the heap is the
    larger of NVSHMEM's default and the buffer plus a margin, rounded up to 2 MiB.
    """
    need = nbytes + _HEAP_MARGIN
    if env_value:
        have = parse_size(env_value)
        if have < need:
            raise ValueError(f"{HEAP_ENV}={env_value!r} ({have} bytes) is too small: this Buffer needs "
                             f"{need} bytes of symmetric heap (raise it or unset it)")
        return have, False
    size = max(_DEFAULT_HEAP, need)
    return -(-size // (2 << 20)) * (2 << 20), True


def pick_device(local_rank: int, visible_count: int) -> int:
    """CUDA device ordinal for this process: the only visible one, else ``local_rank % visible_count``."""
    if visible_count < 1:
        raise RuntimeError("backend='nvshmem' needs a CUDA GPU, and none is visible to this process")
    return 0 if visible_count == 1 else local_rank % visible_count


class _Runtime:
    """Process-wide NVSHMEM state: initialised once, finalised once at exit."""

    def __init__(self) -> None:
        self.group: Optional[MPI.Group] = None
        self.device: Optional[int] = None
        self.heap_bytes = 0
        self.poisoned = False  # a heap timed out: collective teardown could hang
        self.live = 0

    def ensure(self, comm: MPI.Comm, nbytes: int) -> None:
        """Initialise NVSHMEM over ``comm`` (first call) or check ``comm`` matches the NVSHMEM world."""
        if self.group is not None:
            self._check_same_world(comm)
            if nbytes + _HEAP_MARGIN > self.heap_bytes:
                raise ValueError(f"this Buffer needs {nbytes} bytes of symmetric heap, but NVSHMEM was started with "
                                 f"{self.heap_bytes} bytes ({HEAP_ENV}); set {HEAP_ENV} larger before the first Buffer")
            return
        import cupy
        import nvshmem.core as nvs
        from cuda.core import Device

        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = local.rank
        local.Free()
        self.device = pick_device(local_rank, cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(self.device).use()
        dev = Device(self.device)
        dev.set_current()
        self.heap_bytes, export = heap_size_for(nbytes, os.environ.get(HEAP_ENV))
        if export:
            os.environ[HEAP_ENV] = str(self.heap_bytes)
        uid = nvs.get_unique_id(empty=comm.rank != 0)
        comm.Bcast(uid._data.view("int8"), root=0)
        nvs.init(device=dev, uid=uid, rank=comm.rank, nranks=comm.size, initializer_method="uid")
        self.group = comm.Get_group()
        atexit.register(self.finalize)

    def _check_same_world(self, comm: MPI.Comm) -> None:
        group = comm.Get_group()
        same = MPI.Group.Compare(group, self.group) == MPI.IDENT
        group.Free()
        if not same:
            raise ValueError("comm: every nvshmem Buffer of a process must use a communicator over the same "
                             "processes in the same order as the first one (NVSHMEM's world is fixed at init)")

    def finalize(self) -> None:
        """Collective NVSHMEM teardown at exit, skipped once any heap lost step with its peers or any Buffer
        of the process failed (``exit_guard``, which may have finalized MPI already)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        if self.poisoned or exit_guard.failed():
            return
        group.Free()
        import nvshmem.core as nvs

        nvs.finalize()


_RUNTIME = _Runtime()
_LEAKED: List[object] = []  # buffers of timed-out heaps: never freed (nvshmem_free is collective)


class NvshmemHeap:
    """``nbytes`` of symmetric memory on every rank of ``comm`` (collective constructor)."""

    def __init__(self, comm: MPI.Comm, nbytes: int, stores_to: Tuple[int, ...]):
        """Collective over ``comm``; RuntimeError when a rank of ``stores_to`` (reached through stores) has no peer
        view."""
        import cupy
        import nvshmem.core as nvs

        _RUNTIME.ensure(comm, nbytes)
        self.rank = comm.rank
        self.num_ranks = comm.size
        self.device = _RUNTIME.device
        self.nbytes = nbytes
        self.local = nvs.array((nbytes,), dtype="uint8")
        self.local[...] = 0
        cupy.cuda.runtime.deviceSynchronize()
        self.peers: Tuple[object, ...] = tuple(
            self.local if r == self.rank else self._peer_view(nvs, r) for r in range(self.num_ranks))
        # also the barrier after which anyone may signal: every rank zeroed its signals before it
        missing = {rank: peers for rank, peers in enumerate(comm.allgather(
            [r for r in stores_to if self.peers[r] is None])) if peers}
        if missing:  # on every rank alike: the collective free cannot hang
            nvs.free_array(self.local)
            raise RuntimeError(f"ranks {sorted(missing)} cannot reach peers {missing} (rank: peers) by load/store (no "
                               "P2P), but the transport reaches them through stores; use Buffer(transport='puts'), or "
                               "a scaleup_ranks that leaves them out of the rank's node, to send through NVSHMEM puts")
        _RUNTIME.live += 1

    def _peer_view(self, nvs, rank: int):
        """uint8 view of ``rank``'s copy, or None when it is not load/store reachable (``nvshmem_ptr`` returns
        NULL, which nvshmem4py raises as ``NvshmemError``); any other error propagates."""
        from nvshmem.core.nvshmem_types import NvshmemError

        try:
            return nvs.get_peer_array(self.local, rank)
        except NvshmemError:
            return None

    def close(self, collective: bool) -> None:
        """Free the symmetric memory: collectively when every peer closes too, else leak it on purpose
        (and skip NVSHMEM's collective finalize at exit) so that nothing waits on a lost peer."""
        if self.local is None:
            return
        import nvshmem.core as nvs

        local, self.local, self.peers = self.local, None, ()
        _RUNTIME.live -= 1
        if collective:
            nvs.free_array(local)
        else:
            _RUNTIME.poisoned = True
            _LEAKED.append(local)
