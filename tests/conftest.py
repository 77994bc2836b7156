"""Test-session setup. ``tests/mpi`` holds suites that only make sense on every rank of an
``mpirun`` job: ``tests/test_multirank.py`` launches them; a plain pytest run skips collecting them.

Without a GPU the kernels run in the Numba CUDA simulator, chosen here before anything imports
``numba.cuda``, with its warp intrinsics installed once for every test (``helpers.cudasim_warp``)."""
import os

from helpers import cudasim_warp

cudasim_warp.use_without_gpu()

collect_ignore = [] if os.environ.get("EP_COMM_MPI_SUITE") else ["mpi"]
