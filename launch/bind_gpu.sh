#!/usr/bin/env bash
# Bind this MPI rank to one GPU, then exec the command: CUDA_VISIBLE_DEVICES = the local rank's GPU.
#
#   mpirun -np 2 launch/bind_gpu.sh python3 -m ep_comm.bench --config deepseek_v3_prefill
#   EP_COMM_RANKS_PER_GPU=4 mpirun -np 4 launch/bind_gpu.sh python3 -m ep_comm.bench ...   # 4 ranks, one GPU
#
# The local rank comes from the launcher: Open MPI (OMPI_COMM_WORLD_LOCAL_RANK), MPICH/Hydra
# (MPI_LOCALRANKID, PMI_LOCAL_RANK) or Slurm srun (SLURM_LOCALID). The GPUs are the entries of
# CUDA_VISIBLE_DEVICES when it is set (e.g. "4,5,6,7"), else every GPU nvidia-smi lists.
#
# One rank per GPU unless EP_COMM_RANKS_PER_GPU=N (a positive integer; launch/mpirun_gpu.sh
# --ranks-per-gpu N sets it) opts in to N ranks per GPU: local ranks are packed in blocks of N,
# local rank r gets GPU entry r / N (ranks 0..N-1 the first GPU, N..2N-1 the second, ...). A local
# rank beyond the GPUs' N * (number of GPUs) places is refused. Ranks sharing a GPU time-slice its
# SMs unless CUDA MPS runs (launch/with_mps.sh); their figures are not NVLink figures.
#
# This script is the one place that maps ranks to GPUs; its assignment is tested on CPU with a fake
# environment (tests/cli/test_launch_scripts.py).
set -euo pipefail

gpu_list() {  # the GPUs to bind to, one per line
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES"
        return
    fi
    local count
    count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "$count" -eq 0 ]; then
        echo "bind_gpu.sh: nvidia-smi lists no GPU and CUDA_VISIBLE_DEVICES is unset" >&2
        exit 2
    fi
    seq 0 $((count - 1))
}

local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-${SLURM_LOCALID:-}}}}
if [ -z "$local_rank" ]; then
    echo "bind_gpu.sh: no local rank in the environment (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID," \
         "PMI_LOCAL_RANK, SLURM_LOCALID): run it under mpirun or srun" >&2
    exit 2
fi
per_gpu=${EP_COMM_RANKS_PER_GPU:-1}
if ! [[ "$per_gpu" =~ ^[1-9][0-9]*$ ]]; then
    echo "bind_gpu.sh: EP_COMM_RANKS_PER_GPU='$per_gpu': must be a positive integer (ranks per GPU)" >&2
    exit 2
fi
if [ $# -eq 0 ]; then
    echo "usage: bind_gpu.sh CMD [ARGS...]   (run under mpirun or srun)" >&2
    exit 2
fi

listed=$(gpu_list)
mapfile -t gpus <<< "$listed"
slot=$((local_rank / per_gpu))
if [ "$slot" -ge "${#gpus[@]}" ]; then
    if [ "$per_gpu" -eq 1 ]; then
        echo "bind_gpu.sh: local rank $local_rank but only ${#gpus[@]} GPUs (${gpus[*]}): start at most one rank" \
             "per GPU, or opt in to sharing with launch/mpirun_gpu.sh --ranks-per-gpu N (EP_COMM_RANKS_PER_GPU=N)" >&2
    else
        echo "bind_gpu.sh: local rank $local_rank but only ${#gpus[@]} GPUs (${gpus[*]}) x" \
             "EP_COMM_RANKS_PER_GPU=$per_gpu = $((${#gpus[@]} * per_gpu)) ranks: start fewer ranks" \
             "or allow more per GPU" >&2
    fi
    exit 2
fi
export CUDA_VISIBLE_DEVICES=${gpus[$slot]}
exec "$@"
