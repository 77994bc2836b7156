"""GPU baselines for the benchmark (imported only on the GPU path; needs CuPy, and torch for NCCL).

* ``nccl_dedup``: one row per (token, destination rank), tokens grouped by rank, counts exchanged
  with a small ``all_to_all_single``, rows with ``all_to_all_single`` and the real splits;
* ``nccl_megatron``: Megatron-style, one row per (token, expert): a stable argsort of the flattened
  top-k ids, then the same exchange;
* ``device_copy``: a device-to-device copy of the bytes a dispatch delivers to this rank (its received
  rows), on this GPU: what moving those bytes costs at HBM speed, the reference of a one-rank run;
* the NVLink ceiling: a CuPy copy of a large buffer into a peer's symmetric-memory view, all GPUs
  at once (rank ``r`` writes to ``r + 1``). The peer view comes from a ``PeerView`` callable so
  that any transport can supply it; :func:`nvshmem_peer_view` uses nvshmem4py.

All timings go through the benchmark's timer (CUDA events on CuPy's current stream, which is the
legacy default stream torch uses too).
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.bench.measure import Timer, sample_times

PeerView = Callable[[int, int], ContextManager[Any]]
"""``peer_view(nbytes, peer_rank)``: a context yielding a device ``uint8 [nbytes]`` array that lives
on ``peer_rank``'s GPU and is writable from this one. Called collectively by all ranks."""

CEILING_BYTES = 256 << 20


def torch_distributed(comm: MPI.Comm):
    """``torch.distributed`` with an NCCL process group over the ranks of ``comm`` (initialised once).

    Rank 0's address (``$MASTER_ADDR`` if set) and a free port are broadcast over MPI.
    """
    import cupy
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    endpoint = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        endpoint = (os.environ.get("MASTER_ADDR", socket.gethostbyname(socket.gethostname())), port)
    addr, port = comm.bcast(endpoint, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    device = torch.device("cuda", cupy.cuda.Device().id)
    torch.cuda.set_device(device)
    # device_id binds the group to this rank's GPU (no "barrier(): using the device under current context" warning)
    dist.init_process_group("nccl", rank=comm.rank, world_size=comm.size, device_id=device)
    return dist


def close_torch_distributed() -> None:
    """Tear down the NCCL process group, if one was made, so that its watchdog does not outlive it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _to_torch(arr: np.ndarray, device):
    """Host array (float32/float16/ml_dtypes bfloat16, int64, or uint8: packed FP8 rows) -> torch tensor on
    ``device``."""
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int64": torch.int64,
              "uint8": torch.uint8}
    bits = torch.from_numpy(np.ascontiguousarray(arr).view(f"i{arr.dtype.itemsize}"))
    return bits.to(device).view(dtypes[arr.dtype.name])


def rank_rows(x, topk_idx, experts_per_rank: int, num_ranks: int) -> Tuple[Any, Any]:
    """One row per (token, rank reached), grouped by rank: ``(rows [n, H], counts [R] int64)``."""
    import torch

    ranks = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros((x.shape[0], num_ranks + 1), dtype=torch.bool, device=x.device)
    in_rank.scatter_(1, ranks, True)
    in_rank = in_rank[:, :num_ranks]
    _, token = in_rank.t().nonzero(as_tuple=True)
    return x.index_select(0, token), in_rank.sum(dim=0)


def expert_rows(x, topk_idx, experts_per_rank: int, num_ranks: int) -> Tuple[Any, Any]:
    """One row per (token, expert), expert-major (stable argsort): ``(rows [n, H], counts [R] int64)``."""
    import torch

    flat = topk_idx.flatten()
    picked = torch.nonzero(flat >= 0).squeeze(1)
    order = picked[torch.argsort(flat[picked], stable=True)]
    counts = torch.bincount(flat[picked] // experts_per_rank, minlength=num_ranks)
    return x.index_select(0, order // topk_idx.shape[1]), counts


def all_to_all_rows(dist, rows, send_counts):
    """Exchange counts, then rows, with ``all_to_all_single`` and the real splits: received rows ``[m, H]``."""
    import torch

    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    out = rows.new_empty((int(recv_counts.sum()), rows.shape[1]))
    dist.all_to_all_single(out, rows, recv_counts.tolist(), send_counts.tolist())
    return out


def time_nccl_baselines(comm: MPI.Comm, x: np.ndarray, topk_idx: np.ndarray, num_experts: int,
                        warmup: int, iters: int, timer: Timer) -> Dict[str, List[float]]:
    """Seconds per iteration of each NCCL dispatch on this rank's inputs ``x [T, H]`` (or its packed FP8 rows
    ``[T, P]`` uint8 with ``--fp8``), ``topk_idx [T, K]``."""
    import torch

    dist = torch_distributed(comm)
    device = torch.device("cuda", torch.cuda.current_device())
    tx, tidx = _to_torch(x, device), _to_torch(np.asarray(topk_idx, dtype=np.int64), device)
    experts_per_rank = num_experts // comm.size
    times = {}
    for name, layout in (("nccl_dedup", rank_rows), ("nccl_megatron", expert_rows)):
        def body(layout=layout) -> Tuple[float]:
            return (timer(lambda: all_to_all_rows(dist, *layout(tx, tidx, experts_per_rank, comm.size)))[1],)

        times[name] = sample_times(comm, body, warmup, iters)[:, 0].tolist()
    return times


@contextmanager
def nvshmem_peer_view(nbytes: int, peer: int) -> Iterator[Any]:
    """A ``PeerView`` over nvshmem4py: a symmetric ``uint8 [nbytes]`` array, seen through ``peer``'s mapping."""
    import nvshmem.core as nvshmem

    local = nvshmem.array((nbytes,), dtype="uint8")
    try:
        yield nvshmem.get_peer_array(local, peer)
    finally:
        nvshmem.free_array(local)


def nvlink_ceiling(comm: MPI.Comm, peer_view: PeerView, timer: Timer, nbytes: int = CEILING_BYTES,
                   warmup: int = 3, iters: int = 20) -> float:
    """This rank's GB/s copying ``nbytes`` into rank ``r + 1``'s memory while every rank does the same."""
    import cupy

    src = cupy.ones(nbytes, dtype=cupy.uint8)
    with peer_view(nbytes, (comm.rank + 1) % comm.size) as dst:
        times = sample_times(comm, lambda: (timer(lambda: cupy.copyto(dst, src))[1],), warmup, iters)
        comm.Barrier()  # no rank frees its buffer while a peer may still write into it
    return nbytes / float(np.median(times)) / 1e9


def device_copy_times(comm: MPI.Comm, nbytes: int, warmup: int, iters: int, timer: Timer) -> List[float]:
    """Seconds per device-to-device copy of ``nbytes`` bytes on this rank's GPU (``cupy.copyto`` of
    contiguous ``uint8`` arrays: one ``cudaMemcpyAsync``), every rank at once."""
    import cupy

    src = cupy.ones(max(int(nbytes), 1), dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    return sample_times(comm, lambda: (timer(lambda: cupy.copyto(dst, src))[1],), warmup, iters)[:, 0].tolist()
