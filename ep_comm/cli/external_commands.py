"""Output of the machine's own tools (``nvidia-smi``, ``git``) for the reports of the commands: None when a
tool is missing, fails or hangs, never an exception."""
from __future__ import annotations

import shutil
import subprocess
from typing import List, Optional


def command_output(args: List[str]) -> Optional[str]:
    """Output of a command, or None when it is missing or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
