"""Programmatic dependent launch, off by default (``ep_comm/kernels/pdl.py``, ``ep_comm/_launcher/raw.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuda.bindings.driver import CUlaunchAttributeID, CUresult

from ep_comm._launcher import raw
from ep_comm.kernels import switches

HERE = Path(__file__).parent
OK = (CUresult.CUDA_SUCCESS,)


def test_only_registered_functions_launch_programmatically(monkeypatch):
    plain, ex = [], []
    monkeypatch.setattr(raw, "driver_launch", lambda *a: plain.append(a))
    monkeypatch.setattr(raw, "cuLaunchKernelEx", lambda config, f, params, extra: ex.append((config, f, params)) or OK)
    monkeypatch.setattr(raw, "_PROGRAMMATIC", set())
    monkeypatch.setattr(raw, "_CONFIGS", {})
    dependent, other = 0x10, 0x20
    raw.launch(dependent, 4, 256, 64, 0, 0x1234, "dependent")
    assert len(plain) == 1 and not ex and not raw.programmatic(dependent)
    raw.allow_programmatic(dependent)
    raw.launch(dependent, 4, 256, 64, 0, 0x1234, "dependent")
    raw.launch(other, 1, 32, 0, 0, 0x1234, "other")
    assert len(plain) == 2 and len(ex) == 1 and raw.programmatic(dependent) and not raw.programmatic(other)
    config, function, params = ex[0]
    assert int(function) == 0x10 and params == 0x1234
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.blockDimY, config.sharedMemBytes,
            config.numAttrs) == (4, 1, 256, 1, 64, 1)
    attribute = config.attrs[0]
    assert attribute.id == CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1


def test_kernels_are_not_programmatic_by_default():
    from ep_comm.kernels.count import count_kernel

    assert not switches.PDL or os.environ.get("EP_COMM_KERNEL_PDL") == "1"
    assert count_kernel.programmatic_launch == switches.PDL


def test_pdl_compiles_griddepcontrol_into_the_kernels(tmp_path):
    """With ``EP_COMM_KERNEL_PDL=1`` a kernel lets its dependents launch and waits for its prerequisites first."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    env["EP_COMM_KERNEL_PDL"] = "1"
    code = """
import sys, types
import numba.cuda.dispatcher
numba.cuda.dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
import numpy as np
from numba import cuda, typeof
from ep_comm.kernels.routing_check import routing_check_kernel
assert routing_check_kernel.programmatic_launch
args = (np.zeros((4, 2), np.int64), np.zeros(2, np.int64), np.zeros(1, np.uint32), np.zeros(2, np.int64), False)
ptx, _ = cuda.compile_ptx(routing_check_kernel.py_func, tuple(typeof(a) for a in args), cc=(9, 0))
print(ptx)
"""
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        if any(word in run.stderr for word in ("NVVM", "nvvm", "libnvrtc", "NVRTC", "CudaSupportError")):
            pytest.skip(f"no CUDA compiler here: {run.stderr.strip().splitlines()[-1]}")
        pytest.fail(run.stderr[-4000:])
    body = run.stdout[run.stdout.find(".entry"):]  # the kernel, its device functions inlined
    launch, wait = body.find("griddepcontrol.launch_dependents;"), body.find("griddepcontrol.wait;")
    assert 0 <= launch < wait < body.find("ld.global")  # before the kernel touches global memory
