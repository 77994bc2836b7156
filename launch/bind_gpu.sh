#!/usr/bin/env bash
# Bind this MPI rank to one GPU, then exec the command: CUDA_VISIBLE_DEVICES = the local rank's GPU.
#
#   mpirun -np 2 launch/bind_gpu.sh python3 -m ep_comm.bench --config deepseek_v3_prefill
#
# The local rank comes from the launcher: Open MPI (OMPI_COMM_WORLD_LOCAL_RANK), MPICH/Hydra
# (MPI_LOCALRANKID, PMI_LOCAL_RANK) or Slurm srun (SLURM_LOCALID). When CUDA_VISIBLE_DEVICES is
# already a list (e.g. "4,5,6,7"), the local rank picks an entry of that list.
set -euo pipefail

local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-${SLURM_LOCALID:-}}}}
if [ -z "$local_rank" ]; then
    echo "bind_gpu.sh: no local rank in the environment (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID," \
         "PMI_LOCAL_RANK, SLURM_LOCALID): run it under mpirun or srun" >&2
    exit 2
fi

if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
else
    count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "$count" -eq 0 ]; then
        echo "bind_gpu.sh: nvidia-smi lists no GPU and CUDA_VISIBLE_DEVICES is unset" >&2
        exit 2
    fi
    mapfile -t gpus < <(seq 0 $((count - 1)))
fi
if [ "$local_rank" -ge "${#gpus[@]}" ]; then
    echo "bind_gpu.sh: local rank $local_rank but only ${#gpus[@]} GPUs (${gpus[*]}): start at most one rank per GPU" >&2
    exit 2
fi
export CUDA_VISIBLE_DEVICES=${gpus[$local_rank]}
exec "$@"
