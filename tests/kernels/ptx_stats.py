"""Static figures of generated kernels: PTX instructions, 64-bit divisions, registers (``ptxas -v``).

Run as ``python tests/kernels/ptx_stats.py PTX_DIR`` on what ``compile_check.py`` wrote: one line per
PTX file. The registers column needs ``ptxas`` on the PATH (else ``-``).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

WIDE_DIVISION = re.compile(r"^\s*(div|rem)\.[su]64\b", re.MULTILINE)
INSTRUCTION = re.compile(r"^\s*(@!?%p\d+\s+)?[a-z][\w.]*[\s;]", re.MULTILINE)


def wide_divisions(ptx: str) -> int:
    """Number of 64-bit integer divisions and remainders (``div``/``rem`` ``.s64``/``.u64``) in ``ptx``."""
    return len(WIDE_DIVISION.findall(ptx))


def instructions(ptx: str) -> int:
    """Number of instructions in the function bodies of ``ptx`` (directives, labels and braces excluded)."""
    return len(INSTRUCTION.findall(ptx))


def registers(path: Path) -> int | None:
    """Registers per thread of the kernel in ``path`` as ``ptxas -arch=sm_90 -v`` reports; None without ptxas."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    run = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", "/dev/null", str(path)], capture_output=True, text=True,
                         check=True)
    used = re.findall(r"Used (\d+) registers", run.stderr)
    return max(map(int, used)) if used else None


def main(ptx_dir: str) -> None:
    print(f"{'kernel':48} {'instructions':>12} {'div64':>6} {'registers':>9}")
    for path in sorted(Path(ptx_dir).glob("*.ptx")):
        ptx = path.read_text()
        regs = registers(path)
        print(f"{path.stem:48} {instructions(ptx):12} {wide_divisions(ptx):6} {'-' if regs is None else regs:>9}")


if __name__ == "__main__":
    main(sys.argv[1])
