"""``@kernel``: ``cuda.jit(cache=True)`` whose on-disk cache follows every source file of this package.

Numba keys a cached kernel on its own file's modification time and size only, so an edit to a
device function in another file (``warp.py``, say) would leave stale kernels in the cache. Here
each kernel's key is a digest of all of ``ep_comm/kernels/*.py`` instead. The cache sits in
``__pycache__`` next to the sources, or under ``NUMBA_CACHE_DIR``. Kernels that call NVSHMEM
device functions cannot be cached (Numba cannot pickle their linked code): use ``cuda.jit``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from numba import cuda


def sources_digest() -> str:
    """SHA-256 over the names and contents of this package's Python files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


SOURCES_DIGEST = sources_digest()


def kernel(fn: Callable) -> Callable:
    """``cuda.jit(cache=True)(fn)``, its cache entries keyed on :data:`SOURCES_DIGEST`.

    The simulator has no cache; a Numba without the (private) stamp falls back to its own keying.
    """
    dispatcher = cuda.jit(cache=True)(fn)
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if hasattr(cache_file, "_source_stamp"):
        cache_file._source_stamp = SOURCES_DIGEST
    return dispatcher
