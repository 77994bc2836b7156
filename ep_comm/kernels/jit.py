"""``@kernel``: ``cuda.jit(cache=True)`` whose on-disk cache follows every source file the device code reads.

Numba keys a cached kernel on its own file's modification time and size only, so an edit to a
device function in another file (``warp.py``, say) would leave stale kernels in the cache. Here
each kernel's key is a digest of :data:`KEY_SOURCES` instead: every ``ep_comm/kernels/*.py`` and
``ep_comm/contract/protocol.py``, the host/device protocol constants that kernels compile in. This
package holds device code only (the host side is ``ep_comm.launching``), so editing host code keeps
every cached kernel; for the same reason only kernels defined in this package may use ``@kernel``.
``numba_internals.py`` (the shim of Numba's private internals, which sets the key) lives in this
package too, so an edit of it also recompiles every kernel. The cache sits in ``__pycache__`` next to
the sources, or under ``NUMBA_CACHE_DIR``. Kernels that call NVSHMEM device functions cannot be cached
(Numba cannot pickle their linked code): use ``cuda.jit``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Optional

from numba import cuda

from ep_comm.kernels.numba_internals import ENABLE_CUDASIM, compile_without_runtime, set_source_stamp
from ep_comm.kernels.switches import CACHE_SUFFIX, LINEINFO, PDL

PACKAGE_DIR = Path(__file__).parent
PACKAGE_ROOT = PACKAGE_DIR.parent  # ep_comm/
KEY_SOURCES = ("kernels/*.py", "contract/protocol.py")  # under PACKAGE_ROOT: what the key covers


def sources_digest(package_root: Path = PACKAGE_ROOT) -> str:
    """SHA-256 over the paths (relative to ``package_root``) and contents of the files :data:`KEY_SOURCES`
    names under ``package_root`` (default: ``ep_comm``), pattern by pattern, each in name order."""
    root = Path(package_root)
    digest = hashlib.sha256()
    for pattern in KEY_SOURCES:
        for path in sorted(root.glob(pattern)):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


SOURCES_DIGEST = sources_digest()
# what cache entries are keyed on: the digest, and the debug switches back to older kernels when any is set
CACHE_STAMP = SOURCES_DIGEST + CACHE_SUFFIX


def kernel(fn: Optional[Callable] = None, *, max_registers: Optional[int] = None) -> Any:
    """``cuda.jit(cache=True)(fn)``, its cache entries keyed on :data:`CACHE_STAMP` (:data:`SOURCES_DIGEST`, plus
    the ``ep_comm.kernels.switches`` set, if any). ``@kernel(max_registers=N)``: registers per thread capped at
    ``N`` (None: no cap), so that more blocks fit on an SM (ignored by the simulator). Every such kernel starts
    with :func:`ep_comm.kernels.pdl.pdl_enter` (``programmatic_launch`` on the dispatcher tells the launcher), and
    compiles without Numba's runtime calls whatever ``NUMBA_CUDA_ENABLE_NRT`` says
    (:func:`~ep_comm.kernels.numba_internals.runtime_off`: no kernel here allocates on the device).

    ``fn`` must be defined in this package: the digest does not cover other files. The simulator
    has no cache; a Numba without the (private) stamp falls back to its own keying.
    """
    if fn is None:
        return lambda f: kernel(f, max_registers=max_registers)
    source = Path(fn.__code__.co_filename).resolve()
    if source.parent != PACKAGE_DIR.resolve():
        raise ValueError(f"fn={fn.__qualname__} is defined in {source}: @kernel caches only kernels defined in "
                         f"{PACKAGE_DIR} (the cache key covers that package's files only)")
    # the simulator's jit takes no register cap (and has no registers)
    options = {} if max_registers is None or ENABLE_CUDASIM else {"max_registers": max_registers}
    if LINEINFO and not ENABLE_CUDASIM:
        options["lineinfo"] = True
    dispatcher = cuda.jit(cache=True, **options)(fn)
    set_source_stamp(dispatcher, CACHE_STAMP)
    if not ENABLE_CUDASIM:
        compile_without_runtime(dispatcher)
    # every kernel here starts with pdl_enter (kernels/pdl.py): with EP_COMM_KERNEL_PDL=1 its pre-bound launches
    # may use programmatic dependent launch (ep_comm/_launcher/raw.py)
    dispatcher.programmatic_launch = PDL
    return dispatcher
