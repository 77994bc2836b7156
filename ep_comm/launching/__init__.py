"""The protocol's kernel calls: what to launch of ``ep_comm.kernels``, with which shapes and views.

Modules: ``kernel_launches`` (class ``Kernels``: one method per dispatch/combine kernel) on ``launch_shapes``
(its base ``LaunchShapes``: the launch shapes, the persistent workspace, the views of the count blocks),
``weight_return`` (launches of the top-k weights' return route), ``fp8`` (the FP8 payload the scatter reads).
Every launch goes through the private launcher ``ep_comm._launcher`` (pre-bound kernels, recorded calls). None of
these is part of the kernels' cache key (``ep_comm.kernels.jit``): editing them keeps every cached kernel.
"""
