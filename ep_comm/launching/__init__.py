"""The host side of the kernels in ``ep_comm.kernels``: what to launch, with which shapes and views.

Modules: ``kernels`` (class ``Kernels``: the launch shapes, the persistent workspace, one method per
dispatch/combine kernel), ``weight_return`` (launches of the top-k weights' return route),
``views`` (symmetric buffer views, payloads as words, Numba device views), ``bound`` (pre-bound
launches without Numba's dispatcher; Numba's own launches there run with ``occupancy``'s filter of
its low-occupancy warning). None of these is part of the kernels' cache key
(``ep_comm.kernels.jit``): editing them keeps every cached kernel.
"""
