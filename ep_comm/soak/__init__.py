"""The soak test: ``mpirun -np N python -m ep_comm.soak [options]`` (usage and phases: ``__main__``).

Modules: ``plan`` (the shape, each iteration's plan and every rank's inputs, from the seed), ``round_trip``
(one iteration on a Buffer: dispatch, combine, replay and their check), ``phases`` (the soak iterations,
determinism repeats and create/close), ``memory`` (the memory this process holds, and its check),
``summary`` (the results gathered to rank 0 and printed), ``__main__`` (the command line).
"""
