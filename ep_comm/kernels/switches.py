"""Debug-only switches back to the kernels as they were before issue 46, so that one GPU call can measure each
change before and after (``tools/measure_kernels46.sh``).

``EP_COMM_KERNEL_LEGACY`` is a comma-separated list of change names (:data:`CHANGES`), read once at import:

- ``count_cut``: the count walks ``count_tokens_per_warp`` tokens per warp (8 warps, one block, four warp steps each
  at decode) instead of one unit per warp once that leaves the count fewer than ``count_min_warps`` warps;
- ``one_fence``: every thread fences before the last-block ticket and before a host-mapped record's tag, instead
  of one thread after a block barrier;
- ``warp_fold``: the routing check folds every thread's ``(top, first)`` by shared atomics, instead of a warp
  shuffle fold and one shared atomic per warp;
- ``recv_loads``: the compact receive count sums each local expert's count words source by source (one memory round
  trip per source) instead of four sources' loads at a time;
- ``bounds``: the row kernels (scatter, receive copy, combine send and reduce) compile without a register cap;
- ``slots_in_rows`` (host side): a scatter whose rows are cut into pieces (decode) assigns its slots in a launch of
  its own before the rows' launch, and a new routing's dispatch without ``deterministic`` counts for atomic slots,
  instead of the rows' launch taking each entry's stable slot itself (one launch, one dependent step fewer);
- ``count_in_copy`` (host side): a new routing's compact receive into worst-case outputs (``cpu_sync=False``) counts
  in a launch of its own before the copy, instead of in the copy's launch (``receive_counted_compact_kernel``);
- ``count_apart``: in that copy's launch, block 0 writes the receive count and then copies its share of the rows,
  instead of a block of its own (one more in the grid) counting while the others copy every row.

``EP_COMM_KERNEL_MAX_REGISTERS=N`` (debug) sets that cap (:data:`ROW_MAX_REGISTERS`, default 128: two blocks of
256 threads per SM) to ``N`` registers per thread: 80 gives three such blocks, 64 four.
``EP_COMM_KERNEL_REDUCE_MAX_REGISTERS=N`` (debug) sets the bfloat16 combine reduce's alone
(:data:`REDUCE_MAX_REGISTERS`, default 64, or the row kernels' cap where that is lower: four blocks of 256 threads per
SM; ptxas 13.0 fits it in 60 registers without spilling, where the copy kernels spill at 64. On an H100 the prefill
reduce took 71.4 us at 64 against 82.3 at 128, CUDA events, and the decode one 8.6 against 8.4).

``EP_COMM_KERNEL_LINEINFO=1`` (debug, off by default) compiles every ``@kernel`` with line information (numba-cuda's
``lineinfo``), so that Nsight Compute's source page maps each SASS instruction and its stall samples to a Python
line; the CUDA C signal and wait kernels too (NVRTC's ``-lineinfo``, ``ep_comm.transport.signals.MODULE_OPTIONS``).

``EP_COMM_KERNEL_PDL=1`` (debug, off by default) compiles programmatic dependent launch into every kernel and
launches them with it (``ep_comm/kernels/pdl.py``, ``ep_comm/_launcher/raw.py``).

Device-side switches are compile-time constants (Numba freezes module globals), so they are part of the on-disk
cache key (:data:`CACHE_SUFFIX`, ``ep_comm/kernels/jit.py``): a kernel compiled under one setting is never
loaded under another. Unset (the default), every change is in.
"""
from __future__ import annotations

import os

CHANGES = ("count_cut", "one_fence", "warp_fold", "recv_loads", "bounds", "slots_in_rows",
           "count_in_copy", "count_apart")
ENV = "EP_COMM_KERNEL_LEGACY"


def _read(text: str) -> frozenset:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(CHANGES))
    if unknown:
        raise ValueError(f"{ENV}={text!r}: unknown change(s) {unknown}; known: {', '.join(CHANGES)}")
    return names


LEGACY = _read(os.environ.get(ENV, ""))
REGISTERS_ENV = "EP_COMM_KERNEL_MAX_REGISTERS"
DEFAULT_ROW_MAX_REGISTERS = 128
_REGISTERS = os.environ.get(REGISTERS_ENV, "").strip()
# registers per thread of the row kernels (None: no cap), compiled in (numba-cuda's max_registers)
ROW_MAX_REGISTERS = None if "bounds" in LEGACY else int(_REGISTERS or DEFAULT_ROW_MAX_REGISTERS)
_REDUCE_REGISTERS = os.environ.get("EP_COMM_KERNEL_REDUCE_MAX_REGISTERS", "").strip()
DEFAULT_REDUCE_MAX_REGISTERS = 64
REDUCE_MAX_REGISTERS = None if ROW_MAX_REGISTERS is None else \
    int(_REDUCE_REGISTERS or min(DEFAULT_REDUCE_MAX_REGISTERS, ROW_MAX_REGISTERS))
PDL = os.environ.get("EP_COMM_KERNEL_PDL", "").strip() == "1"
LINEINFO = os.environ.get("EP_COMM_KERNEL_LINEINFO", "").strip() == "1"
CACHE_SUFFIX = (("+legacy:" + ",".join(sorted(LEGACY))) if LEGACY else "") + \
    (f"+registers:{_REGISTERS}" if _REGISTERS else "") + \
    (f"+reduce-registers:{_REDUCE_REGISTERS}" if _REDUCE_REGISTERS else "") + ("+pdl" if PDL else "") + \
    ("+lineinfo" if LINEINFO else "")


def legacy(name: str) -> bool:
    """Whether change ``name`` (one of :data:`CHANGES`) is switched back to its old form."""
    if name not in CHANGES:
        raise ValueError(f"unknown change {name!r}; known: {', '.join(CHANGES)}")
    return name in LEGACY
