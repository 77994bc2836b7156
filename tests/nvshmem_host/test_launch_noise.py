"""Noise a GPU run should not print, checked on CPU: Numba's low-occupancy warning is silenced for
ep_comm's launches only (the CUDA simulator does not warn, so a dispatcher that warns stands in for
Numba's), and ``launch/nvshmem.env`` keeps NVSHMEM off InfiniBand where no RDMA device exists."""
from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest
from numba.cuda.core.errors import NumbaPerformanceWarning

from ep_comm._launcher.occupancy import quiet_low_occupancy
from ep_comm._launcher.prebound import PreboundKernel

ENV_FILE = Path(__file__).resolve().parents[2] / "launch" / "nvshmem.env"
LOW = "Grid size 4 will likely result in GPU under-utilization due to low occupancy."
OTHER = "Host array used in CUDA kernel will incur copy overhead to/from device."


def warnings_of(action) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [(w.category, str(w.message)) for w in caught]


def warn_both() -> None:
    warnings.warn(NumbaPerformanceWarning(LOW))
    warnings.warn(NumbaPerformanceWarning(OTHER))


def test_the_filter_drops_the_warning_in_terminal_colours_too():
    """Numba highlights its messages where a colour package is installed (the GPU images have one)."""
    coloured = f"\x1b[1m{LOW}\x1b[0m"

    def inside() -> None:
        with quiet_low_occupancy():
            warnings.warn(NumbaPerformanceWarning(coloured))
            warnings.warn(NumbaPerformanceWarning(f"\x1b[1m{OTHER}\x1b[0m"))

    assert warnings_of(inside) == [(NumbaPerformanceWarning, f"\x1b[1m{OTHER}\x1b[0m")]


def test_the_filter_drops_the_low_occupancy_warning_only_inside_it():
    def inside() -> None:
        with quiet_low_occupancy():
            warn_both()
            warnings.warn(UserWarning(LOW))  # another category, same text: kept

    assert warnings_of(inside) == [(NumbaPerformanceWarning, OTHER), (UserWarning, LOW)]
    assert warnings_of(warn_both) == [(NumbaPerformanceWarning, LOW), (NumbaPerformanceWarning, OTHER)]


class WarningDispatcher:
    """A dispatcher whose launch configuration warns like Numba's (fewer than 128 blocks)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, config):
        warn_both()
        return lambda *args: self.launches.append((config, args))


def test_ep_comms_launch_through_numba_keeps_every_other_warning():
    dispatcher = WarningDispatcher()
    bound = PreboundKernel(dispatcher, to_numba=lambda a: a, enabled=False)
    assert warnings_of(lambda: bound(4, 32, 0, 0, 7)) == [(NumbaPerformanceWarning, OTHER)]
    assert dispatcher.launches == [((4, 32, 0, 0), (7,))]


def remote_transport(tmp_path: Path, devices: list, **preset: str) -> str:
    """NVSHMEM_REMOTE_TRANSPORT after loading launch/nvshmem.env with ``devices`` under a fake sysfs."""
    sysfs = tmp_path / "infiniband"
    sysfs.mkdir()
    for name in devices:
        (sysfs / name).mkdir()
    env = {"PATH": "/usr/bin:/bin", "EP_COMM_IB_SYSFS": str(sysfs), **preset}
    done = subprocess.run(["bash", "-c", f'set -a; . "{ENV_FILE}"; set +a; printenv NVSHMEM_REMOTE_TRANSPORT'],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.stderr == ""
    return done.stdout.strip()


@pytest.mark.parametrize("devices, preset, expected", [
    ([], {}, "none"),                                          # a single node without IB: no IB attempt
    (["mlx5_0"], {}, ""),                                      # an RDMA device: NVSHMEM's default (ibrc)
    ([], {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}, "ucx"),          # RDMA turned on by hand: kept
    ([], {"NVSHMEM_IB_ENABLE_IBGDA": "1"}, ""),                # IBGDA asked for: not overridden
])
def test_nvshmem_env_turns_the_remote_transport_off_without_rdma_devices(tmp_path, devices, preset, expected):
    assert remote_transport(tmp_path, devices, **preset) == expected
