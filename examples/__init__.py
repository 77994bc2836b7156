"""Runnable examples of ep_comm: a Mixture-of-Experts layer on the expand dispatch.

- ``examples.moe_layer``: NumPy (mpi backend) or CuPy (nvshmem backend) arrays;
- ``examples.torch_moe_layer``: the same layer with PyTorch tensors;
- ``examples.moe_overlap``: two micro-batches of the layer, the dispatch of one overlapping the experts of
  the other (``return_recv_hook``), checked and timed against the layer on each in turn.

Run one under ``mpirun``: ``mpirun -np 4 python -m examples.moe_layer`` on CPU, or
``launch/mpirun_gpu.sh 2 examples.moe_layer --dtype bfloat16`` on two GPUs.
"""
