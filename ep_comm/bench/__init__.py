"""The ep_comm benchmark: ``mpirun -np N python -m ep_comm.bench --config NAME``.

Modules: ``config`` (the shapes in ``configs/``), ``measure`` (round-trip check and timing on one rank),
``report`` (aggregation over ranks, text/JSON/CSV/plots, progress line), ``baselines`` (NCCL and
NVLink-ceiling comparisons, GPU only, imported lazily), ``__main__`` (the command line).
"""
