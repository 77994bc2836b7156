#!/usr/bin/env bash
# Run a Python module on N GPU ranks of one node with Open MPI, one rank per GPU unless asked otherwise.
#
#   launch/mpirun_gpu.sh [--ranks-per-gpu K] N MODULE [ARGS...]
#   launch/mpirun_gpu.sh 2 ep_comm.bench --config deepseek_v3_prefill --json results/prefill.json
#   launch/mpirun_gpu.sh --ranks-per-gpu 2 2 ep_comm.bench --config deepseek_v3_decode   # 2 ranks, 1 GPU
#   launch/with_mps.sh --ranks-per-gpu 4 -- launch/mpirun_gpu.sh 4 ep_comm.soak --backend nvshmem  # under MPS
#
# Loads launch/nvshmem.env (values already set win), puts the repository on PYTHONPATH, forwards
# the NVSHMEM/NCCL/Numba/CUDA variables with -x (Open MPI does not forward the environment; CUDA_*
# includes launch/with_mps.sh's CUDA_MPS_* variables) and binds each rank to its GPU with
# launch/bind_gpu.sh. MPIRUN (default: mpirun) must be Open MPI's, the MPI that mpi4py is built
# against on the GPU machines; PYTHON (default python3) is run by its absolute path; BIND_TO (default none) is passed to --bind-to.
#
# --ranks-per-gpu K (a positive integer; exported as EP_COMM_RANKS_PER_GPU=K, which bind_gpu.sh reads)
# opts in to K ranks per GPU: local ranks 0..K-1 share the first GPU, K..2K-1 the second, ... Without
# it (or EP_COMM_RANKS_PER_GPU in the environment, which launch/with_mps.sh exports) a second rank on a
# GPU is refused. Ranks
# sharing a GPU run their kernels concurrently only under CUDA MPS (launch/with_mps.sh); their
# bandwidth figures are not NVLink figures (ep_comm.bench marks them).
# On the device machines: source .device-kit/setup.sh first (the GPU machine kit's README says why).
set -euo pipefail

usage="usage: $0 [--ranks-per-gpu K] N MODULE [ARGS...]   (N = number of ranks, K = ranks per GPU, positive integers)"
if [ "${1:-}" = "--ranks-per-gpu" ]; then
    if ! [[ "${2:-}" =~ ^[1-9][0-9]*$ ]]; then
        echo "$0: --ranks-per-gpu '${2:-}': must be a positive integer (ranks per GPU)" >&2
        exit 2
    fi
    export EP_COMM_RANKS_PER_GPU=$2
    shift 2
fi
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "$usage" >&2
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

# The interpreter as an absolute path: an mpirun given by its absolute path (MPIRUN=/usr/bin/mpirun) acts as
# --prefix and puts its own bin/ first on the ranks' PATH, where another python3 may be found (on the GPU machines,
# /usr/bin/python3, which has no NumPy, instead of the image's).
if ! python=$(command -v "${PYTHON:-python3}"); then
    echo "$0: PYTHON='${PYTHON:-python3}' is not on PATH: set PYTHON to the interpreter the ranks should run" >&2
    exit 2
fi

# Open MPI binds each rank to one core when np <= 2: the Python thread, the NVSHMEM proxy and
# Open MPI's own progress then share that core, and the host-bound launch path stalls for whole
# scheduler slices (ms). Unbound by default; BIND_TO=core (or socket, numa) restores a binding.
exec "$mpirun_bin" "${root[@]}" -np "$nranks" --bind-to "${BIND_TO:-none}" "${forward[@]}" \
    "$launch/bind_gpu.sh" "$python" -m "$module" "$@"
