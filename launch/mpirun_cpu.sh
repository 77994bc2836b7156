#!/usr/bin/env bash
# Run a Python module on N CPU ranks with the venv's mpirun (MPICH from the `mpich` wheel).
#
#   launch/mpirun_cpu.sh N MODULE [ARGS...]
#   launch/mpirun_cpu.sh 4 ep_comm.bench --config cpu_demo
#
# The venv is $VIRTUAL_ENV when one is active, else .venv next to this directory. The repository goes
# first on PYTHONPATH, so `examples.*` modules run from any working directory.
set -euo pipefail

if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N MODULE [ARGS...]   (N = number of ranks, a positive integer)" >&2
    exit 2
fi
nranks=$1 module=$2
shift 2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VIRTUAL_ENV:-$repo/.venv}
if [ ! -x "$venv/bin/mpirun" ]; then
    echo "$0: no mpirun in $venv/bin: create the venv first (see README.md: python3 -m venv .venv && pip install -e .)" >&2
    exit 2
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Oversubscription is the point on a laptop or CI box: more ranks than cores is fine for correctness runs.
exec "$venv/bin/mpirun" -np "$nranks" "$venv/bin/python" -m "$module" "$@"
