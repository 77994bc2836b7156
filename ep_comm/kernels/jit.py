"""``@kernel``: ``cuda.jit(cache=True)`` whose on-disk cache follows every source file of this package.

Numba keys a cached kernel on its own file's modification time and size only, so an edit to a
device function in another file (``warp.py``, say) would leave stale kernels in the cache. Here
each kernel's key is a digest of all of ``ep_comm/kernels/*.py`` instead. This package holds device
code only (the host side is ``ep_comm.launching``), so editing host code keeps every cached kernel;
for the same reason only kernels defined in this package may use ``@kernel``. The cache sits in
``__pycache__`` next to the sources, or under ``NUMBA_CACHE_DIR``. Kernels that call NVSHMEM
device functions cannot be cached (Numba cannot pickle their linked code): use ``cuda.jit``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from numba import cuda

from ep_comm.kernels.numba_internals import set_source_stamp

PACKAGE_DIR = Path(__file__).parent


def sources_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the names and contents of the Python files in ``package_dir`` (default: this
    package), in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(package_dir).glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


SOURCES_DIGEST = sources_digest()


def kernel(fn: Callable) -> Callable:
    """``cuda.jit(cache=True)(fn)``, its cache entries keyed on :data:`SOURCES_DIGEST`.

    ``fn`` must be defined in this package: the digest does not cover other files. The simulator
    has no cache; a Numba without the (private) stamp falls back to its own keying.
    """
    source = Path(fn.__code__.co_filename).resolve()
    if source.parent != PACKAGE_DIR.resolve():
        raise ValueError(f"fn={fn.__qualname__} is defined in {source}: @kernel caches only kernels defined in "
                         f"{PACKAGE_DIR} (the cache key covers that package's files only)")
    dispatcher = cuda.jit(cache=True)(fn)
    set_source_stamp(dispatcher, SOURCES_DIGEST)
    return dispatcher
