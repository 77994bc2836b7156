"""The CUDA C kernels of ``ep_comm.transport.signals`` compile for sm_90 with NVRTC, without a GPU (they run
only on a GPU: CuPy compiles them there). Skipped where NVRTC is missing."""
from __future__ import annotations

import re

import pytest

from ep_comm.transport.signals import _SOURCE

nvrtc = pytest.importorskip("cuda.bindings.nvrtc")


def _ptx(source: str) -> str:
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
