"""Helpers shared by the test modules (no fixtures, no tests): ``cudasim_warp`` (warp intrinsics for the
Numba CUDA simulator, installed once by the root conftest)."""
