"""The one private launcher: how a compiled kernel reaches the driver, for every host-side caller.

Modules: ``raw`` (the one ``cuLaunchKernel``), ``param_blocks`` (parameter blocks in Numba's ABI), ``prebound``
(:class:`~ep_comm._launcher.prebound.PreboundKernel`: Numba's dispatcher once per argument kind, then one driver
call on a patched parameter block; ``occupancy`` quiets Numba's low-occupancy warning on those first launches),
``recorded_calls`` (the launches of one call recorded once and launched again with new data pointers),
``slotted`` (a compiled CUDA C kernel with named parameter slots, as the signal kernels are launched),
``device_arrays`` (Numba device views). What to launch, with which shapes, is the protocol's
(``ep_comm.launching``, ``ep_comm.transport.signals``), not this package's.
"""
