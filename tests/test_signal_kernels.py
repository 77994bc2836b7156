"""The CUDA C kernels of ``ep_comm.transport.signals`` compile for sm_90 with NVRTC, without a GPU (they run
only on a GPU: CuPy compiles them there; skipped where NVRTC is missing), and their host wrappers size the
count blocks from the received count words."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ep_comm.transport.signals import _SOURCE, _count_words


def test_count_blocks_are_one_per_destination_of_the_received_width():
    received = np.zeros((2, 3, 5), np.int64)  # [2, R, 1 + L]: R = 3, L = 4
    assert _count_words(np.zeros((3, 5), np.int32), received) == 5
    assert _count_words(None, received) == 5  # the wait alone zeroes a missing rank's 5 words
    assert _count_words(None, None) == 0
    with pytest.raises(ValueError, match=r"counts has shape \(3, 1\): must be \[R, 1 \+ L\] = \(3, 5\)"):
        _count_words(np.zeros((3, 1), np.int32), received)
    with pytest.raises(ValueError, match="counts given without counts_by_parity"):
        _count_words(np.zeros((3, 5), np.int32), None)


def _ptx(source: str) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"signals.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    options = [b"--std=c++14", b"-arch=compute_90"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        pytest.fail(log.decode())
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.decode()


def test_signal_kernels_compile_with_acquire_release_at_system_scope():
    try:
        ptx = _ptx(_SOURCE)
    except RuntimeError as exc:  # the bindings without a libnvrtc to load
        pytest.skip(f"no NVRTC here: {exc}")
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert entries == {"advance_step", "signal_and_wait", "wait_signals"}
    assert "ld.acquire.sys.global.b64" in ptx and "st.release.sys.global.b64" in ptx
    assert "globaltimer" in ptx and "nanosleep" in ptx
