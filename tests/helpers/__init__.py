"""Support code the test modules share: no tests and no fixtures here (fixtures live in ``tests/conftest.py``).

``tests/conftest.py`` puts ``tests/`` on ``sys.path`` (pytest's default import mode), so the modules import
these as ``helpers.<module>``; ``cudasim_warp`` (warp intrinsics and a block runner of greenlets for the Numba CUDA
simulator) is installed once by the root conftest.
"""
