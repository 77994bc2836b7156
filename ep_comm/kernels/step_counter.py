"""The collective step as the kernels see it: a device counter, so that launches need no host value.

A Buffer's step counter is an int64 ``[1]`` device array holding the number of the last step that
signalled: the signal kernel of every dispatch, combine and close advances it
(``ep_comm.transport.signals.SignalKernels.signal_and_wait``). Kernels read the buffer parity (which half of the
double-buffered symmetric regions a step uses) from it instead of taking it as an argument: the
same launches are then right at every step, which is what a CUDA graph replay needs. Kernels that
run before their step's signal (the senders) look one step ahead (``ahead=1``); the ones after it
(the receivers) do not. A constant ``[0]`` array with ``ahead=0`` selects parity 0 (the puts
staging area has one half).
"""
from __future__ import annotations

from numba import cuda


@cuda.jit(device=True)
def step_parity(step, ahead):
    """Parity (0 or 1) of step number ``step[0] + ahead`` (``step``: int64 ``[1]``)."""
    return (step[0] + ahead) & 1
