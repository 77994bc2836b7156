"""The kernels compile for sm_90 with the real Numba-CUDA compiler, and the combine arithmetic has no FMA.

The simulator runs kernels as Python, so it would not notice code that Numba cannot type; this
compiles each launch ``Kernels`` makes, in a subprocess outside the simulator. Skipped where NVVM or
NVRTC is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ptx_stats import wide_divisions

HERE = Path(__file__).parent
# under pytest-xdist (.ci/run) every test of this module on one worker: the module fixture compiles every kernel
# (about a minute of CPU), once per worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("compile")


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    env["NUMBA_CUDA_ENABLE_NRT"] = "1"  # as launch/nvshmem.env sets it: the kernels must compile without it anyway
    run = subprocess.run([sys.executable, str(HERE / "compile_check.py"), str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0:
        missing = ("NVVM", "nvvm", "libnvrtc", "NVRTC", "CudaSupportError")
        if any(word in run.stderr for word in missing) and "TypingError" not in run.stderr:
            pytest.skip(f"no CUDA compiler here: {run.stderr.strip().splitlines()[-1]}")
        pytest.fail(run.stderr[-4000:])
    return out


def test_every_kernel_compiles(ptx_dir):
    names = {p.name.split(".")[0] for p in ptx_dir.glob("*.ptx")}
    assert names == {"routing_check_kernel", "count_kernel", "scatter_kernel", "scatter_rows_kernel",
                     "receive_count_kernel", "receive_count_words_kernel", "receive_compact_kernel",
                     "receive_counted_compact_kernel",
                     "receive_place_kernel", "receive_rows_kernel", "combine_copy_kernel", "combine_expand_kernel", "combine_expand_bf16_kernel",
                     "combine_reduce_kernel", "combine_reduce_bf16_kernel", "scatter_kernel-fp8pair",
                     "scatter_kernel-fp8cast", "scatter_rows_kernel-fp8pair", "scatter_rows_kernel-fp8cast",
                     "inbox_send_kernel", "combine_meta_kernel", "relay_kernel",
                     "node_reduce_kernel", "dispatch_rows_kernel", "combine_rows_kernel"}


def test_no_kernel_calls_numbas_runtime(ptx_dir):
    """With ``NUMBA_CUDA_ENABLE_NRT=1`` in the environment, no kernel calls Numba's runtime (a reference count call
    per array sliced or passed on: dozens of calls and tens of registers per kernel): they allocate nothing."""
    for path in ptx_dir.glob("*.ptx"):
        ptx = path.read_text()
        assert "NRT_" not in ptx, path.name


def test_fp8_cast_in_the_scatter_divides_exactly_and_converts_in_pairs(ptx_dir):
    """The FP8 cast's ``v / scale`` is IEEE float32 division (as NumPy's), never an approximate one; its values
    become FP8 two at a time in one conversion instruction."""
    paths = list(ptx_dir.glob("scatter*_kernel-fp8cast.*.ptx"))
    assert len(paths) == 6
    for path in paths:
        ptx = path.read_text()
        assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx, path.name
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, path.name


def test_the_fp8_pair_and_bfloat16_cast_move_16_bytes_per_access(ptx_dir):
    """The pair's FP8 bytes are copied, and bfloat16 is read for the cast, 16 bytes per access."""
    for name in ("scatter_kernel-fp8pair", "scatter_rows_kernel-fp8pair", "scatter_kernel-fp8cast",
                 "scatter_rows_kernel-fp8cast"):
        ptx = (ptx_dir / f"{name}.bfloat16.ptx").read_text()
        assert "ld.v2.b64" in ptx, name


def test_no_fused_multiply_add_in_combine(ptx_dir):
    for path in ptx_dir.glob("combine_*.ptx"):
        ptx = path.read_text()
        assert "fma." not in ptx, path.name
    for path in ptx_dir.glob("combine_expand*_kernel.*.ptx"):
        assert "mul.rn.f32" in path.read_text()


def test_wide_bfloat16_combine_moves_16_bytes_per_access(ptx_dir):
    for name in ("combine_expand_bf16_kernel", "combine_reduce_bf16_kernel"):
        ptx = (ptx_dir / f"{name}.bfloat16.ptx").read_text()
        assert "ld.v2.b64" in ptx and "st.v2.b64" in ptx, name


def test_lane_masks_stay_32_bit(ptx_dir):
    """A 64-bit popc means a lane mask was widened: Numba's int32 masks sign-extend lane 31's bit."""
    for path in ptx_dir.glob("*.ptx"):
        assert "popc.b64" not in path.read_text(), path.name


def test_warp_collectives_are_real_instructions(ptx_dir):
    ptx = (ptx_dir / "count_kernel.bfloat16.ptx").read_text()
    for instruction in ("match.any.sync", "shfl.sync.up", "atom.global.add.u64", "atom.global.exch.b64",
                        "ld.global.cv"):
        assert instruction in ptx


def test_the_routing_check_folds_by_warp_shuffles(ptx_dir):
    """The count and the routing check fold their lanes' verdicts by xor shuffles (one shared atomic per warp)."""
    from ep_comm.kernels.switches import legacy

    if legacy("warp_fold"):
        pytest.skip("EP_COMM_KERNEL_LEGACY=warp_fold")
    for name in ("count_kernel", "routing_check_kernel"):
        assert "shfl.sync.bfly" in (ptx_dir / f"{name}.bfloat16.ptx").read_text(), name


def test_no_programmatic_launch_unless_asked(ptx_dir):
    from ep_comm.kernels.switches import PDL

    if PDL:
        pytest.skip("EP_COMM_KERNEL_PDL=1")
    for path in ptx_dir.glob("*.ptx"):
        assert "griddepcontrol" not in path.read_text(), path.name


def test_index_division_is_32_bit(ptx_dir):
    """No 64-bit ``div``/``rem`` in any kernel (some 70 SASS instructions each): index quotients go through
    ``ep_comm/kernels/index32.py`` and stride loops add their step to an int32 index."""
    for path in ptx_dir.glob("*.ptx"):
        assert wide_divisions(path.read_text()) == 0, path.name
