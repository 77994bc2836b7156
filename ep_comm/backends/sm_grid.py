"""How many SMs the nvshmem backend's kernels use on a rank, and the ``Kernels`` launch shape that gives."""
from __future__ import annotations

from typing import Dict, Optional

from mpi4py import MPI

from ep_comm.contract.checks import check_num_sms_fits

BLOCKS_PER_SM = 2  # blocks of the unit-cut kernels (count, scatter, receive count/place) per SM
STREAM_BLOCKS_PER_SM = 8  # blocks of the row-streaming kernels (receive rows, combine) per SM


def sms_in_effect(comm: MPI.Comm, num_sms: Optional[int], device_sms: int) -> int:
    """The SM count the kernels use on this rank: ``num_sms``, or ``device_sms`` (this rank's GPU) for None.

    Collective: every rank learns every rank's SM count, so a ``num_sms`` above any rank's raises
    the same ValueError (naming ``num_sms``, the value and the fewest SMs) on every rank.
    """
    check_num_sms_fits(num_sms, comm.allgather(int(device_sms)))
    return device_sms if num_sms is None else int(num_sms)


def grid_shape(num_sms: int) -> Dict[str, int]:
    """``Kernels`` launch shape for ``num_sms`` SMs: ``num_blocks = 2 * num_sms`` (unit-cut kernels) and
    ``stream_blocks = 8 * num_sms`` (row-streaming kernels); 132 SMs (H200) give 264 / 1056."""
    return dict(num_blocks=BLOCKS_PER_SM * num_sms, stream_blocks=STREAM_BLOCKS_PER_SM * num_sms)
