"""The protocol's kernel calls: what to launch of ``ep_comm.kernels``, with which shapes and views.

Modules: ``kernel_launches`` (class ``Kernels``: one method per dispatch/combine kernel, each on the stream it is
given) over ``launch_shapes`` (``LaunchShapes``: the launch shapes and the views of the count blocks, no arrays;
``Workspace``: the persistent workspace the kernels share, allocated by ``Workspace.allocate``), ``weight_return``
(launches of the top-k weights' return route), ``fp8`` (the FP8 payload the scatter reads). Every launch goes
through the private launcher ``ep_comm._launcher`` (pre-bound kernels, recorded calls). None of these is part of
the kernels' cache key (``ep_comm.kernels.jit``): editing them keeps every cached kernel.
"""
