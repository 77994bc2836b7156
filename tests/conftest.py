"""Test-session setup. ``tests/mpi`` holds suites that only make sense on every rank of an
``mpirun`` job: ``tests/test_multirank.py`` launches them; a plain pytest run skips collecting them."""
import os

collect_ignore = [] if os.environ.get("EP_COMM_MPI_SUITE") else ["mpi"]
