"""Where a benchmark's figures come from: the command line, the git commit of the checkout ep_comm runs
from (only when its files are that commit's: else None, and why), and on GPU the rank's GPU model and driver. The
package versions are :func:`ep_comm.cli.versions.versions`."""
from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from ep_comm.cli.external_commands import command_output

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the ep_comm package


def command_line(num_ranks: int) -> str:
    """The benchmark's command as a user would type it: ``mpirun -np N python -m ep_comm.bench ARGS``."""
    return f"mpirun -np {num_ranks} python -m ep_comm.bench {shlex.join(sys.argv[1:])}".rstrip()


RUN_FROM = ("ep_comm/", "configs/")  # what a run reads from the checkout: an untracked file there changes the run


def git_commit(root: Path = PACKAGE_ROOT) -> Dict[str, Any]:
    """The commit the files under ``root`` are, for the bench's ``meta``: ``{"git_commit": sha, "git_dirty": False}``
    when ``root`` is the top of a git checkout (an editable install) whose tracked files are the commit's and that has
    no untracked file where a run reads (:data:`RUN_FROM`: a stale ``.git`` under newer files shows them untracked).
    Otherwise never a commit: ``{"git_commit": None, "git_dirty": True or None (unknown), "git_commit_note": why}``
    (changed or untracked files, no git, not a checkout: an installed wheel, or ``root`` inside another
    repository)."""
    if shutil.which("git") is None:
        return _no_commit("git is not installed: the files cannot be matched to a commit")
    top = command_output(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top).resolve() != root.resolve():
        return _no_commit(f"{root} is not the top of a git checkout (an installed package?)")
    sha = command_output(["git", "-C", str(root), "rev-parse", "HEAD"])
    status = command_output(["git", "-C", str(root), "status", "--porcelain=v2", "--untracked-files=all"])
    if sha is None or status is None:
        return _no_commit(f"git rev-parse HEAD or git status failed in {root}")
    changed = _changed_paths(status)
    if changed:
        return {"git_commit": None, "git_dirty": True,
                "git_commit_note": f"{len(changed)} file(s) differ from HEAD {sha[:12]} ({', '.join(changed[:3])}"
                                   f"{', ...' if len(changed) > 3 else ''}): the run is of no commit"}
    return {"git_commit": sha, "git_dirty": False}


_PATH_FIELD = {"1": 8, "2": 9, "u": 10, "?": 1}  # git status --porcelain=v2: the path's field on each kind of line


def _changed_paths(status: str) -> List[str]:
    """The paths of ``git status --porcelain=v2`` output that make the files not HEAD's: every tracked change, and
    the untracked files under :data:`RUN_FROM` (a renamed file by its new path)."""
    paths = []
    for line in status.splitlines():
        path = line.split(" ", _PATH_FIELD[line[0]])[-1].split("\t")[0]
        if line[0] != "?" or path.startswith(RUN_FROM):
            paths.append(path)
    return paths


def _no_commit(why: str) -> Dict[str, Any]:
    return {"git_commit": None, "git_dirty": None, "git_commit_note": why}


def gpu_model(pci_bus_id: str) -> Optional[str]:
    """``"NVIDIA H200, driver 570.124.06"`` for the GPU at ``pci_bus_id`` (CuPy's form,
    ``0000:18:00.0``) from ``nvidia-smi``; None when nvidia-smi is missing or does not list it."""
    listing = command_output(["nvidia-smi", "--query-gpu=pci.bus_id,name,driver_version", "--format=csv,noheader"])
    wanted = pci_bus_id.lower().split(":", 1)[-1]  # nvidia-smi writes an 8-digit domain, CuPy 4
    for line in (listing or "").splitlines():
        bus, name, driver = (field.strip() for field in line.split(",", 2))
        if bus.lower().split(":", 1)[-1] == wanted:
            return f"{name}, driver {driver}"
    return None
