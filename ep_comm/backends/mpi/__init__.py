"""The ``mpi`` backend (``MpiBackend``): the whole protocol on CPU over MPI windows, and the reference the GPU backend is
checked against. Its modules: ``backend`` (the class), ``steps`` (how a step runs), ``context`` (what the parts are
given), ``protocol`` (dispatch and combine) over the route ``flat`` or ``forwarding``."""
from ep_comm.backends.mpi.backend import MpiBackend

__all__ = ["MpiBackend"]
