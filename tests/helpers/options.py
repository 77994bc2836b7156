"""The test session's choices from its command line: ``--backend``, ``--transport``, ``--ranks``, the virtual nodes
(``--scaleup-ranks``, ``--forwarding``) and the Hypothesis profile, and how to hand them on to the pytest sessions
inside an ``mpirun`` job.

``tests/conftest.py`` records them once per session (``record``); code that is not a fixture, such as the
collective suites' module-level setup, reads them with ``current()``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

BACKENDS = ("mpi", "nvshmem")
# job sizes of the multi-rank tests without --ranks; nvshmem: the GPU machines have 1 or 2 GPUs
DEFAULT_JOB_SIZES = {"mpi": (1, 2, 3, 4), "nvshmem": (1, 2)}


def parse_ranks(text: str) -> Tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: the job sizes given with ``--ranks``.

    Raises:
        argparse.ArgumentTypeError: an entry is not a positive integer (pytest reports it as a usage error).
    """
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--ranks={text!r}: must be a comma-separated list of positive integers, "
                                         "e.g. 1,2,4")
    return sizes


@dataclass(frozen=True)
class SessionOptions:
    """What the tests of this session run on.

    ``ranks`` is ``--ranks`` as given (None without it): each test that starts jobs has its own default.
    ``hypothesis_profile`` is ``--hypothesis-profile`` as given (None: the default profile, ``ci``).
    ``scaleup_ranks`` and ``forwarding``: the Buffers of the collective suites in (virtual) nodes of that many
    ranks (None: one node), sending to the other nodes flat or through their forwarders.
    """

    backend: str = "mpi"
    transport: str = "stores"
    ranks: Optional[Tuple[int, ...]] = None
    hypothesis_profile: Optional[str] = None
    scaleup_ranks: Optional[int] = None
    forwarding: bool = False

    @property
    def job_sizes(self) -> Tuple[int, ...]:
        """Rank counts of the multi-rank contract jobs: ``--ranks``, else the backend's default."""
        return self.ranks or DEFAULT_JOB_SIZES[self.backend]

    def forwarded_nodes(self, num_ranks: int) -> Optional[int]:
        """``scaleup_ranks`` of this session's Buffers on ``num_ranks`` ranks when they forward (``--forwarding``
        with more than one node: the forwarded combine's order), else None."""
        if self.forwarding and self.scaleup_ranks is not None and self.scaleup_ranks < num_ranks:
            return self.scaleup_ranks
        return None

    def buffer_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments selecting the backend (and on nvshmem its transport), and the virtual nodes where
        given, for ``ep_comm.Buffer``."""
        kwargs: Dict[str, Any] = {"backend": self.backend}
        if self.backend == "nvshmem":
            kwargs["transport"] = self.transport
        if self.scaleup_ranks is not None:
            kwargs.update(scaleup_ranks=self.scaleup_ranks, forwarding=self.forwarding)
        return kwargs

    def pytest_args(self) -> List[str]:
        """These options on the command line of the pytest session each rank of a job runs."""
        args = ["--backend", self.backend, "--transport", self.transport]
        if self.ranks:
            args += ["--ranks", ",".join(str(n) for n in self.ranks)]
        if self.hypothesis_profile:
            args += ["--hypothesis-profile", self.hypothesis_profile]
        if self.scaleup_ranks is not None:
            args += ["--scaleup-ranks", str(self.scaleup_ranks)]
        if self.forwarding:
            args.append("--forwarding")
        return args


_recorded: Optional[SessionOptions] = None


def record(options: SessionOptions) -> None:
    """Remember this session's options (called by ``tests/conftest.py`` at configure time)."""
    global _recorded
    _recorded = options


def current() -> SessionOptions:
    """This session's options; only inside a pytest session that loaded ``tests/conftest.py``."""
    if _recorded is None:
        raise RuntimeError("no session options recorded: run the tests with pytest from the repository "
                           "(tests/conftest.py records --backend, --transport and --ranks)")
    return _recorded
