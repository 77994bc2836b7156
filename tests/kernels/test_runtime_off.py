"""Kernels compile without Numba's runtime (NRT) whatever ``NUMBA_CUDA_ENABLE_NRT`` says, and the setting comes back
after each compile (``ep_comm.kernels.numba_internals.runtime_off``; the PTX itself: ``test_compile.py``)."""
from __future__ import annotations

import threading

import pytest
from numba.cuda.core import config

from ep_comm.kernels.numba_internals import compile_without_runtime, compiles_without_runtime, runtime_off


class _Dispatcher:
    """A dispatcher whose ``compile`` records the runtime setting it ran under (and fails on ``"bad"``)."""

    def __init__(self) -> None:
        self.seen: list = []

    def compile(self, sig):
        self.seen.append(config.CUDA_ENABLE_NRT)
        if sig == "bad":
            raise TypeError("no such overload")
        return f"kernel{sig}"


@pytest.fixture
def runtime_on():
    saved = getattr(config, "CUDA_ENABLE_NRT", False)
    config.CUDA_ENABLE_NRT = True
    yield
    config.CUDA_ENABLE_NRT = saved


def test_a_compile_runs_without_the_runtime_and_the_setting_comes_back(runtime_on):
    dispatcher = _Dispatcher()
    assert not compiles_without_runtime(dispatcher)
    compile_without_runtime(dispatcher)
    assert compiles_without_runtime(dispatcher)
    assert dispatcher.compile("(int64,)") == "kernel(int64,)"
    with pytest.raises(TypeError, match="no such overload"):
        dispatcher.compile("bad")
    assert dispatcher.seen == [False, False]
    assert config.CUDA_ENABLE_NRT is True


def test_no_other_thread_compiles_while_the_runtime_is_off(runtime_on):
    """Numba's compiler lock is held inside: a compile on another thread waits, so it never sees the setting."""
    seen = []
    other = threading.Thread(target=lambda: seen.append(_compile_on_the_side()))
    with runtime_off():
        assert config.CUDA_ENABLE_NRT is False
        other.start()
        other.join(0.2)
        assert other.is_alive() and not seen  # blocked on the lock
    other.join(5)
    assert seen == [True]


def _compile_on_the_side() -> bool:
    """What a compile under Numba's lock on another thread reads of the runtime setting."""
    from numba.cuda.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        return config.CUDA_ENABLE_NRT
