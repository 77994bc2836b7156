"""Where a benchmark's figures come from: the command line, the git commit of the checkout ep_comm runs
from (with a dirty flag), and on GPU the rank's GPU model and driver. The package versions are
:func:`ep_comm.cli.versions.versions`."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Dict, Optional, Union

from ep_comm.cli.external_commands import command_output

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the ep_comm package


def command_line(num_ranks: int) -> str:
    """The benchmark's command as a user would type it: ``mpirun -np N python -m ep_comm.bench ARGS``."""
    return f"mpirun -np {num_ranks} python -m ep_comm.bench {shlex.join(sys.argv[1:])}".rstrip()


def git_commit(root: Path = PACKAGE_ROOT) -> Optional[Dict[str, Union[str, bool]]]:
    """``{"git_commit": sha, "git_dirty": bool}`` when ``root`` is the top of a git checkout (an
    editable install); dirty = tracked files differ from the commit (untracked files do not count).
    None otherwise: an installed wheel, no git, or ``root`` inside another repository."""
    top = command_output(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top).resolve() != root.resolve():
        return None
    sha = command_output(["git", "-C", str(root), "rev-parse", "HEAD"])
    changes = command_output(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    if sha is None or changes is None:
        return None
    return {"git_commit": sha, "git_dirty": bool(changes)}


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
