"""Test-session setup: the options that choose what the tests run on, the Hypothesis profiles, and the
per-rank result files of the pytest sessions inside ``mpirun`` jobs.

Options (also session fixtures): ``--backend mpi|nvshmem`` (the backend of the collective suites),
``--transport stores|puts`` (the nvshmem backend's transport), ``--ranks 1,2,4`` (job sizes of the
multi-rank tests), ``--scaleup-ranks N`` and ``--forwarding`` (the collective suites' Buffers in virtual nodes of
``N`` ranks, flat or forwarded). Hypothesis profiles: ``ci`` (the default), ``gpu`` and ``nodes`` (fewer examples), chosen with
``--hypothesis-profile``.

``tests/mpi`` holds collective suites marked ``pytest.mark.mpi``: ``tests/jobs/test_multirank.py`` runs them with
``--with-mpi`` (pytest-mpi) on every rank of ``mpirun`` jobs. A session without ``--with-mpi`` does not collect
them unless they are named on the command line (then pytest-mpi skips them, saying why): they run, but not in
this process, so they are no skips of its own.

Without a GPU the kernels run in the Numba CUDA simulator, chosen here before anything imports
``numba.cuda``, with its warp intrinsics and greenlet block runner installed once for every test
(``helpers.cudasim_warp``; in the sessions under ``mpirun`` only once a test module imported ``numba.cuda``).
"""
from pathlib import Path
from typing import Tuple

import pytest
from helpers import cudasim_warp, rank_results
from helpers.options import BACKENDS, SessionOptions, current, parse_ranks, record
from hypothesis import settings

from ep_comm.contract.choices import TRANSPORTS

cudasim_warp.select_without_gpu()  # before any test module imports numba.cuda (none of the imports above does)

settings.register_profile("ci", max_examples=150, deadline=None, database=None)
settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=20)
# the randomized suite in virtual nodes (tests/jobs/test_multirank.py: ten jobs of 4..8 ranks on top of the one-node
# jobs at 1..4 ranks, which keep ci's 150)
settings.register_profile("nodes", parent=settings.get_profile("ci"), max_examples=50)
settings.load_profile("ci")  # --hypothesis-profile, applied by Hypothesis's plugin after this, overrides it


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ep_comm", "what the ep_comm tests run on")
    group.addoption("--backend", choices=BACKENDS, default="mpi",
                    help="backend of the collective suites (tests/mpi): mpi (default) or nvshmem (GPUs)")
    group.addoption("--transport", choices=TRANSPORTS, default="stores",
                    help="the nvshmem backend's transport: stores (peer stores, default), puts (nvshmem puts) or auto "
                         "(stores in a node, puts between nodes)")
    group.addoption("--ranks", type=parse_ranks, default=None,
                    help="job sizes of the multi-rank tests, e.g. 1,2,4 (default: 1,2,3,4 on mpi, 1,2 on nvshmem; "
                         "2 for tests/gpu)")
    group.addoption("--scaleup-ranks", type=int, default=None,
                    help="the collective suites' Buffers in virtual nodes of this many ranks (default: one node)")
    group.addoption("--forwarding", action="store_true",
                    help="with --scaleup-ranks: Buffer(forwarding=True), to other nodes through their forwarders")


MPI_SUITES = Path(__file__).parent / "mpi"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave ``tests/mpi`` to the ``mpirun`` jobs of ``tests/jobs/test_multirank.py`` unless ``--with-mpi`` is given."""
    if collection_path == MPI_SUITES and not config.getoption("--with-mpi", default=False):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin opens --junitxml's path
def pytest_configure(config: pytest.Config) -> None:
    record(SessionOptions(config.getoption("backend"), config.getoption("transport"), config.getoption("ranks"),
                          config.getoption("--hypothesis-profile"), config.getoption("scaleup_ranks"),
                          config.getoption("forwarding")))
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath:
        config.option.xmlpath = rank_results.rank_path(xmlpath, rank_results.rank_from_environment())
    if not config.getoption("--with-mpi", default=False):
        cudasim_warp.use_without_gpu()  # a session under mpirun imports Numba only if its tests do (below)


def pytest_sessionstart(session: pytest.Session) -> None:
    """A collective session on ``nvshmem``: the kernels compiled on every rank before the first test, outside its
    timeout (``helpers.kernel_warmup`` says why)."""
    if not session.config.getoption("--with-mpi", default=False) or current().backend != "nvshmem":
        return
    from helpers import kernel_warmup  # imports mpi4py: never in a session that runs no collective suite

    if kernel_warmup.gpu_stack_present():
        seconds = kernel_warmup.compile_kernels()
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"ep_comm: nvshmem kernels compiled in {seconds:.1f} s before the first test "
                                "(helpers.kernel_warmup)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In a session under ``mpirun`` (``--with-mpi``): the simulator's intrinsics once a test module has imported
    ``numba.cuda`` (the collective suites on the mpi backend never do, and their ranks skip Numba's import)."""
    cudasim_warp.install_if_imported()


@pytest.fixture(scope="session")
def session_options() -> SessionOptions:
    """Every option of this session."""
    return current()


@pytest.fixture(scope="session")
def backend(session_options: SessionOptions) -> str:
    """``--backend``."""
    return session_options.backend


@pytest.fixture(scope="session")
def transport(session_options: SessionOptions) -> str:
    """``--transport``."""
    return session_options.transport


@pytest.fixture(scope="session")
def ranks(session_options: SessionOptions) -> Tuple[int, ...]:
    """Job sizes of the multi-rank contract jobs: ``--ranks``, else the backend's default."""
    return session_options.job_sizes
