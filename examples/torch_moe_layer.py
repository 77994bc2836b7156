"""The MoE layer of ``examples.moe_layer`` with PyTorch tensors, checked against the same reference.

    mpirun -np 4 python -m examples.torch_moe_layer                       # CPU: mpi backend
    launch/mpirun_gpu.sh 2 examples.torch_moe_layer --dtype bfloat16       # GPUs: nvshmem backend

Router, expert MLPs and the check are those of ``examples.moe_layer``; only the array operations
change (:class:`TorchOps`). Tensors meet the Buffer like this:

- GPU (nvshmem backend): CUDA tensors go into ``dispatch``/``combine`` as they are (the backend takes
  them through DLPack, zero copy); its CuPy outputs come back with ``torch.from_dlpack``.
- CPU (mpi backend): tensors go in as NumPy views and outputs come back as tensors, both through
  DLPack (``numpy.from_dlpack`` / ``torch.from_dlpack``, zero copy).

bfloat16 crosses as int16 bits (NumPy has no bfloat16 of its own; ml_dtypes' is viewed onto the bits).
PyTorch and CuPy both work on the legacy default stream here, so no extra synchronisation is needed.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

if __package__ in (None, ""):  # run as a file (python examples/torch_moe_layer.py): make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ep_comm
from ep_comm.cli import exit_collectively
from examples.moe_layer import ArrayOps, parse_args, run

try:
    import torch
except ImportError:  # reported by main(), so that importing this module never fails
    torch = None


class TorchOps(ArrayOps):
    """:class:`ArrayOps` over PyTorch tensors on ``device`` (``cpu`` with the mpi backend, a CUDA device
    with nvshmem). ``dtype`` is the payload dtype as a NumPy dtype (the Buffer's)."""

    def __init__(self, device: torch.device, dtype: Any):
        super().__init__(torch, dtype)
        self.device = device
        self.torch_dtype = getattr(torch, self.dtype.name)  # the payload names are torch's

    def row_max(self, a: torch.Tensor) -> torch.Tensor:
        return a.amax(dim=-1, keepdim=True)

    def row_sum(self, a: torch.Tensor) -> torch.Tensor:
        return a.sum(dim=-1, keepdim=True)

    def topk(self, a: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        top = torch.topk(a, k, dim=-1)
        return top.values, top.indices

    def float32(self, a: torch.Tensor) -> torch.Tensor:
        return a.float()

    def to_payload(self, a: torch.Tensor) -> torch.Tensor:
        return a.to(self.torch_dtype)

    def asarray(self, host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(host).to(self.device)

    def to_host(self, a: torch.Tensor) -> np.ndarray:
        return a.cpu().numpy()

    def to_buffer(self, a: torch.Tensor) -> Any:
        """CUDA tensors as they are (the nvshmem backend imports them by DLPack); CPU tensors as NumPy views."""
        if a.is_cuda:
            return a
        if a.dtype == torch.bfloat16:
            return np.from_dlpack(a.view(torch.int16)).view(self.dtype)
        return np.from_dlpack(a)

    def from_buffer(self, a: Any) -> torch.Tensor:
        """A NumPy or CuPy Buffer output as a tensor on the same device, zero copy."""
        if a.dtype.name == "bfloat16":
            return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)


def torch_ops(buf: ep_comm.Buffer) -> TorchOps:
    """Tensors on the CPU for the mpi backend, on the Buffer's GPU (CuPy's current device) for nvshmem."""
    if buf.backend == "nvshmem":
        import cupy

        device = torch.device("cuda", cupy.cuda.Device().id)
        torch.cuda.set_device(device)
        return TorchOps(device, buf.geometry.dtype)
    return TorchOps(torch.device("cpu"), buf.geometry.dtype)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args("python -m examples.torch_moe_layer", argv, MPI.COMM_WORLD.size)
    if torch is None:
        print("examples.torch_moe_layer needs PyTorch: pip install -e '.[torch]'", file=sys.stderr)
        return 2
    return run(args, torch_ops, "torch_moe_layer")


if __name__ == "__main__":
    exit_collectively(main)
