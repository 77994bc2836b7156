"""The ``nvshmem`` backend (``NvshmemBackend``): the protocol on GPUs over the NVSHMEM symmetric heap. Its modules:
``backend`` (the class), ``steps`` (how a step runs on the caller's stream, the context the protocols share),
``dispatch`` and ``combine`` (the general path), ``prepared`` (the prepared path), ``capture`` (the CUDA-graph capture
policy), ``cupy_device`` (stream, reads, allocations)."""
from ep_comm.backends.nvshmem.backend import NvshmemBackend

__all__ = ["NvshmemBackend"]
