"""One result file per rank of an ``mpirun`` job running pytest, instead of parsing the ranks' interleaved stdout.

The job's command line is the same on every rank: it asks for ``--junitxml=DIR/rank-{rank}.xml`` and
``tests/conftest.py`` fills in each rank's number from the MPI launcher's environment (``rank_path``).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import List

RANK_FIELD = "{rank}"
# the rank as MPICH's Hydra, Open MPI and PMIx launchers announce it to each process
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def rank_from_environment() -> int:
    """This process's rank in its ``mpiexec`` job; 0 outside one (a singleton MPI process)."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def pattern(directory: Path) -> str:
    """The ``--junitxml`` value that makes every rank of a job write ``directory/rank-<rank>.xml``."""
    return str(directory / f"rank-{RANK_FIELD}.xml")


def rank_path(path_pattern: str, rank: int) -> str:
    """``path_pattern`` (a ``--junitxml`` value) with ``{rank}`` replaced by ``rank``."""
    return path_pattern.replace(RANK_FIELD, str(rank))


@dataclass(frozen=True)
class RankResult:
    """The counts of one rank's pytest session and the text of its failed tests."""

    rank: int
    tests: int
    failures: int
    errors: int
    skipped: int
    failed_texts: List[str]

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped

    def summary(self) -> str:
        return (f"rank {self.rank}: {self.passed} passed, {self.failures} failed, {self.errors} errors, "
                f"{self.skipped} skipped")


def read(directory: Path, rank: int) -> RankResult:
    """Parse ``directory/rank-<rank>.xml``, the JUnit XML that rank's pytest session wrote."""
    root = ET.parse(rank_path(pattern(directory), rank)).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failed = [f"{case.get('classname')}::{case.get('name')}\n{problem.get('message', '')}\n{problem.text or ''}"
              for suite in suites for case in suite.iter("testcase")
              for problem in case if problem.tag in ("failure", "error")]
    return RankResult(rank, *(sum(int(suite.get(key, 0)) for suite in suites)
                              for key in ("tests", "failures", "errors", "skipped")), failed)
