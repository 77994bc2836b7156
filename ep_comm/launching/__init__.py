"""The host side of the kernels in ``ep_comm.kernels``: what to launch, with which shapes and views.

Modules: ``kernel_launches`` (class ``Kernels``: one method per dispatch/combine kernel) on ``launch_shapes``
(its base ``LaunchShapes``: the launch shapes, the persistent workspace, the views of the count blocks),
``weight_return`` (launches of the top-k weights' return route), ``fp8`` (the FP8 payload the scatter reads),
``device_arrays`` (Numba device views, 16-byte row checks), ``bound`` (pre-bound launches without Numba's
dispatcher; Numba's own launches there run with ``occupancy``'s filter of its low-occupancy warning) on
``param_blocks`` (parameter blocks in Numba's ABI), ``plans`` (launch plans replayed with new data pointers),
``raw`` (the one ``cuLaunchKernel``). None of these is part of the kernels' cache key (``ep_comm.kernels.jit``):
editing them keeps every cached kernel.
"""
