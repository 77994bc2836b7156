"""Static figures of generated kernels: PTX instructions, 64-bit divisions, registers and SASS instructions.

Run as ``python tests/kernels/ptx_stats.py PTX_DIR`` on what ``compile_check.py`` wrote: one line per
PTX file. The registers and SASS columns need ``ptxas`` on the PATH (else ``-``).
"""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

WIDE_DIVISION = re.compile(r"^\s*(div|rem)\.[su]64\b", re.MULTILINE)
INSTRUCTION = re.compile(r"^\s*(@!?%p\d+\s+)?[a-z][\w.]*[\s;]", re.MULTILINE)


def wide_divisions(ptx: str) -> int:
    """Number of 64-bit integer divisions and remainders (``div``/``rem`` ``.s64``/``.u64``) in ``ptx``."""
    return len(WIDE_DIVISION.findall(ptx))


def instructions(ptx: str) -> int:
    """Number of instructions in the function bodies of ``ptx`` (directives, labels and braces excluded)."""
    return len(INSTRUCTION.findall(ptx))


def text_bytes(cubin: bytes) -> int:
    """Bytes of machine code in a 64-bit little-endian ELF ``cubin``: its ``.text.*`` sections."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]  # sh_offset of the section-name table
    total = 0
    for name, _, _, _, _, size in sections:
        if cubin[names + name:].startswith(b".text."):
            total += size
    return total


def assemble(path: Path) -> tuple[int, int] | None:
    """``(registers per thread, SASS instructions)`` of the kernel in ``path``, assembled by ``ptxas -arch=sm_90
    -v`` (16 bytes an instruction); None without ptxas on the PATH."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        run = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", str(cubin), str(path)], capture_output=True,
                             text=True, check=True)
        code = text_bytes(cubin.read_bytes())
    return max(map(int, re.findall(r"Used (\d+) registers", run.stderr))), code // 16


def main(ptx_dir: str) -> None:
    print(f"{'kernel':48} {'PTX':>6} {'div64':>6} {'registers':>9} {'SASS':>6}")
    for path in sorted(Path(ptx_dir).glob("*.ptx")):
        ptx = path.read_text()
        registers, sass = assemble(path) or ("-", "-")
        print(f"{path.stem:48} {instructions(ptx):6} {wide_divisions(ptx):6} {registers:>9} {sass:>6}")


if __name__ == "__main__":
    main(sys.argv[1])
