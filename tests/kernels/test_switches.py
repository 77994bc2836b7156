"""The debug switches back to the kernels before issue 46 (``ep_comm.kernels.switches``)."""
from __future__ import annotations

import pytest

from ep_comm.kernels import switches


def test_switch_names_are_checked():
    assert switches._read("") == frozenset()
    assert switches._read(" count_cut, bounds ,") == {"count_cut", "bounds"}
    with pytest.raises(ValueError, match="unknown change"):
        switches._read("count_cut,nope")
    with pytest.raises(ValueError, match="unknown change"):
        switches.legacy("nope")


def test_unset_switches_keep_the_cache_key():
    from ep_comm.kernels.jit import CACHE_STAMP, SOURCES_DIGEST

    assert switches.CACHE_SUFFIX == ("" if not switches.LEGACY else switches.CACHE_SUFFIX)
    assert CACHE_STAMP == SOURCES_DIGEST + switches.CACHE_SUFFIX


def test_row_kernels_are_capped_at_128_registers_by_default():
    if switches.LEGACY or switches._REGISTERS:
        pytest.skip("switches set in the environment")
    assert switches.ROW_MAX_REGISTERS == switches.DEFAULT_ROW_MAX_REGISTERS == 128


def test_bf16_combine_reduce_is_capped_at_64_registers_by_default():
    if switches.LEGACY or switches._REGISTERS or switches._REDUCE_REGISTERS:
        pytest.skip("switches set in the environment")
    assert switches.REDUCE_MAX_REGISTERS == switches.DEFAULT_REDUCE_MAX_REGISTERS == 64
