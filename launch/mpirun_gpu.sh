#!/usr/bin/env bash
# Run a Python module on N GPU ranks of one node with Open MPI, one rank per GPU.
#
#   launch/mpirun_gpu.sh N MODULE [ARGS...]
#   launch/mpirun_gpu.sh 2 ep_comm.bench --config deepseek_v3_prefill --json results/prefill.json
#
# Loads launch/nvshmem.env (values already set win), puts the repository on PYTHONPATH, forwards
# the NVSHMEM/NCCL/Numba/CUDA variables with -x (Open MPI does not forward the environment) and
# binds each rank to its GPU with launch/bind_gpu.sh. MPIRUN (default: mpirun) must be Open MPI's,
# the MPI that mpi4py is built against on the GPU machines; PYTHON defaults to python3; BIND_TO
# (default none) is passed to --bind-to.
# On the device machines: source .device-kit/setup.sh first (the GPU machine kit's README says why).
set -euo pipefail

if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N MODULE [ARGS...]   (N = number of ranks = GPUs, a positive integer)" >&2
    exit 2
fi
nranks=$1 module=$2
shift 2

launch=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$launch")
mpirun_bin=${MPIRUN:-mpirun}
if ! "$mpirun_bin" --version 2>/dev/null | grep -q "Open MPI"; then
    echo "$0: '$mpirun_bin' is not Open MPI's mpirun (a venv with the mpich wheel puts MPICH first on PATH);" \
         "set MPIRUN=/usr/bin/mpirun or use launch/mpirun_cpu.sh for CPU runs" >&2
    exit 2
fi

set -a
# shellcheck source=nvshmem.env
. "$launch/nvshmem.env"
set +a
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

forward=()
for name in $(compgen -e); do
    case "$name" in
        NVSHMEM_*|NCCL_*|NUMBA_*|CUDA_*|EP_COMM_*|PYTHONPATH|LD_LIBRARY_PATH|PATH|MASTER_ADDR) forward+=(-x "$name") ;;
    esac
done
root=()
if [ "$(id -u)" -eq 0 ]; then
    root=(--allow-run-as-root)
fi

# Open MPI binds each rank to one core when np <= 2: the Python thread, the NVSHMEM proxy and
# Open MPI's own progress then share that core, and the host-bound launch path stalls for whole
# scheduler slices (ms). Unbound by default; BIND_TO=core (or socket, numa) restores a binding.
exec "$mpirun_bin" "${root[@]}" -np "$nranks" --bind-to "${BIND_TO:-none}" "${forward[@]}" \
    "$launch/bind_gpu.sh" "${PYTHON:-python3}" -m "$module" "$@"
