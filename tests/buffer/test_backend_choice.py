"""``backend="auto"`` on CPU with the GPU stack stubbed (``sys.modules``, ``builtins.__import__``): "not installed"
and "no device" choose ``mpi`` and say so; any other failure of the stack is a RuntimeError naming it, from
``choose_backend`` and from ``Buffer``, never a silent fall back to the CPU backend (issue 40)."""
from __future__ import annotations

import builtins
import logging
import sys
import types
from typing import Callable

import pytest
from mpi4py import MPI

import ep_comm
from ep_comm.backends import BackendChoice, choose_backend, resolve_backend

SHAPE = dict(num_experts=2, hidden=8, num_topk=1, num_max_tokens_per_rank=4, dtype="float32")


class CUDARuntimeError(RuntimeError):
    """CuPy's runtime error: its ``status`` is the ``cudaError_t``."""

    def __init__(self, status: int):
        super().__init__(f"status {status}")
        self.status = status


def fake_cupy(count: Callable[[], int]) -> types.ModuleType:
    """A ``cupy`` whose ``cuda.runtime.getDeviceCount`` is ``count``."""
    cupy = types.ModuleType("cupy")
    runtime = types.SimpleNamespace(getDeviceCount=count, CUDARuntimeError=CUDARuntimeError)
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return cupy


def raising(exc: BaseException) -> Callable[[], int]:
    """A device count that raises ``exc``."""
    def count() -> int:
        raise exc
    return count


@pytest.fixture
def stack(monkeypatch):
    """Install a GPU stack: ``stack(cupy)`` puts ``cupy`` (None: not installed) and an importable nvshmem4py in
    ``sys.modules``."""
    def install(cupy) -> None:
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "nvshmem", types.ModuleType("nvshmem"))
        monkeypatch.setitem(sys.modules, "nvshmem.core", types.ModuleType("nvshmem.core"))
    return install


def fail_import(monkeypatch, module: str, exc: BaseException) -> None:
    """``import module`` raises ``exc``."""
    real = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == module:
            raise exc
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", importing)


def test_cupy_not_installed_chooses_mpi_and_says_so(stack):
    stack(None)
    choice = choose_backend("auto")
    assert choice.name == "mpi" and "CuPy is not installed" in choice.reason, choice


def test_nvshmem4py_not_installed_chooses_mpi_and_says_so(stack, monkeypatch):
    stack(fake_cupy(lambda: 1))
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    choice = choose_backend("auto")
    assert choice.name == "mpi" and "nvshmem4py is not installed" in choice.reason, choice


@pytest.mark.parametrize("status, name", [(100, "cudaErrorNoDevice"), (35, "cudaErrorInsufficientDriver")])
def test_no_device_or_no_driver_chooses_mpi_and_says_so(stack, status, name):
    stack(fake_cupy(raising(CUDARuntimeError(status))))
    choice = choose_backend("auto")
    assert choice.name == "mpi" and f"no CUDA device ({name}" in choice.reason, choice


def test_zero_devices_chooses_mpi(stack):
    stack(fake_cupy(lambda: 0))
    assert choose_backend("auto") == BackendChoice("mpi", "auto: CuPy counts 0 CUDA devices")


def test_a_device_chooses_nvshmem_and_counts_it(stack):
    stack(fake_cupy(lambda: 2))
    choice = choose_backend("auto")
    assert choice.name == "nvshmem" and "sees 2 CUDA device(s)" in choice.reason, choice


def test_a_named_backend_is_taken_as_asked():
    assert choose_backend("mpi") == BackendChoice("mpi", "backend='mpi' was asked for")
    with pytest.raises(ValueError, match="backend='gpu': must be one of"):
        choose_backend("gpu")


@pytest.mark.parametrize("module, exc", [
    ("nvshmem.core", OSError("libnvshmem_host.so.3: cannot open shared object file")),
    ("nvshmem.core", RuntimeError("nvshmem: bootstrap plugin failed")),
    ("cupy", ImportError("CuPy failed to load libcudart.so.12")),
    ("cupy", ModuleNotFoundError("No module named 'cupy._core'", name="cupy._core")),
], ids=["OSError", "RuntimeError", "ImportError", "missing-submodule"])
def test_a_broken_import_is_an_error_naming_it(stack, monkeypatch, module, exc):
    stack(fake_cupy(lambda: 1))
    fail_import(monkeypatch, module, exc)
    with pytest.raises(RuntimeError, match=f"importing the GPU stack .* failed with {type(exc).__name__}: ") as info:
        choose_backend("auto")
    assert info.value.__cause__ is exc and str(exc) in str(info.value)


@pytest.mark.parametrize("exc", [CUDARuntimeError(999), OSError("libcuda.so.1: cannot open shared object file")],
                         ids=["cudaErrorUnknown", "OSError"])
def test_a_failing_device_count_is_an_error_naming_it(stack, exc):
    stack(fake_cupy(raising(exc)))
    with pytest.raises(RuntimeError, match=f"getDeviceCount\\(\\) failed with {type(exc).__name__}: ") as info:
        choose_backend("auto")
    assert info.value.__cause__ is exc


def test_resolve_backend_logs_its_grounds(stack, caplog):
    stack(None)
    with caplog.at_level(logging.DEBUG, logger="ep_comm.backends"):
        assert resolve_backend("auto") == "mpi"
    assert "backend='auto' resolves to 'mpi': auto: CuPy is not installed" in caplog.text


def test_buffer_auto_runs_on_mpi_without_the_gpu_stack(stack):
    stack(None)
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="auto") as buf:
        assert buf.backend == "mpi"


def test_buffer_auto_with_a_broken_gpu_stack_raises_naming_it(stack, monkeypatch):
    stack(fake_cupy(lambda: 1))
    fail_import(monkeypatch, "nvshmem.core", OSError("libnvshmem_host.so.3: cannot open shared object file"))
    with pytest.raises(RuntimeError, match="failed with OSError: libnvshmem_host.so.3"):
        ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="auto")
