"""Ranks sharing a GPU (several ranks per GPU, e.g. ``launch/mpirun_gpu.sh --ranks-per-gpu N`` under
CUDA MPS): how the benchmark detects them and what it says about such a run.

Their "NVLink" bytes never leave the GPU, and NCCL refuses two ranks on one GPU, so such a run
skips the NCCL baselines and the NVLink ceiling, and marks every figure with :data:`NOTE`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from mpi4py import MPI

NOTE = "shared GPU: not an NVLink figure"
BASELINES_SKIPPED = "skipped: ranks share a GPU (NCCL refuses two ranks on one GPU)"
CEILING_SKIPPED = "skipped: ranks share a GPU (a copy into a peer's memory stays on the GPU, no NVLink)"


def any_shared(gpu_ids: Sequence[Optional[str]]) -> bool:
    """Whether two ranks name the same GPU.

    Args:
        gpu_ids: one entry per rank, its GPU's PCI bus id (or UUID); None for a rank without a GPU
            (the mpi backend), which shares nothing.

    Returns:
        True when some id appears more than once.
    """
    present = [g for g in gpu_ids if g is not None]
    return len(set(present)) < len(present)


def ranks_share_a_gpu(comm: MPI.Comm, gpu_id: Optional[str]) -> bool:
    """Collective over ``comm``: whether any two of its ranks use the same GPU (the same on every rank).

    Args:
        comm: the run's communicator; every rank calls this.
        gpu_id: this rank's GPU PCI bus id, None without a GPU.
    """
    return any_shared(comm.allgather(gpu_id))


def skip_line(no_baselines: bool) -> str:
    """The one line rank 0 prints when ranks share a GPU: what is skipped and why."""
    skipped = "the NVLink ceiling" if no_baselines else "the NCCL baselines (NCCL refuses two ranks on one GPU) and " \
                                                        "the NVLink ceiling"
    return f"ep_comm.bench: ranks share a GPU: {skipped} skipped; every figure is marked \"{NOTE}\""
