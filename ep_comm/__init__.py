"""ep_comm: expert-parallel Mixture-of-Experts dispatch and combine.

``Buffer`` is the public API (see README.md); ``backend="mpi"`` runs on CPU over MPI one-sided
windows, ``backend="nvshmem"`` on GPUs over NVSHMEM symmetric memory.
"""
from ep_comm._version import __version__ as __version__
from ep_comm.buffer import Buffer
from ep_comm.contract.layout import DispatchLayout
from ep_comm.errors import BufferUnusableError, PeerAbortedError, RoutingError, TimeoutError
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle
from ep_comm.recv_hook import RecvHook

__all__ = ["Buffer", "BufferUnusableError", "CombineOutput", "DispatchLayout", "DispatchOutput", "EPHandle",
           "PeerAbortedError", "RecvHook", "RoutingError", "TimeoutError"]
