#!/usr/bin/env bash
# Run a command under its own CUDA MPS control daemon, so that several ranks on one GPU run their
# kernels concurrently instead of time-slicing the GPU.
#
#   launch/with_mps.sh [--ranks-per-gpu N] -- CMD [ARGS...]
#   launch/with_mps.sh --ranks-per-gpu 2 -- launch/mpirun_gpu.sh 2 ep_comm.bench --config deepseek_v3_decode
#
# Starts `nvidia-cuda-mps-control -f` (in the foreground, as this script's own child, so that it is
# reaped when it quits instead of lingering as a zombie of the container's init) with fresh pipe and
# log directories (mktemp), exported to CMD
# as CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (launch/mpirun_gpu.sh forwards CUDA_*), so
# the run never talks to, nor stops, a daemon it did not start. N ranks per GPU (a positive integer,
# default $EP_COMM_RANKS_PER_GPU or 1) split the SMs: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE =
# floor(100 / N), so the shares of a GPU's ranks sum to at most 100 %, and EP_COMM_RANKS_PER_GPU = N
# is exported for launch/bind_gpu.sh (the opt-in to N ranks per GPU). After CMD ends, fails or is
# interrupted (INT, TERM and HUP are passed on to CMD as TERM), the daemon is told to quit, and the
# last line says whether it is gone. The exit status is CMD's (2 for bad options or no MPS).
# Needs the rights to start MPS on the GPU (root on the device machines).
set -euo pipefail

usage="usage: $0 [--ranks-per-gpu N] -- CMD [ARGS...]   (N = ranks per GPU, a positive integer)"
per_gpu=${EP_COMM_RANKS_PER_GPU:-1}
while [ $# -gt 0 ]; do
    case $1 in
        --ranks-per-gpu) per_gpu=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
        -h|--help) echo "$usage"; exit 0 ;;
        --) shift; break ;;
        *) echo "$0: unknown option '$1'" >&2; echo "$usage" >&2; exit 2 ;;
    esac
done
if ! [[ "$per_gpu" =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: --ranks-per-gpu '$per_gpu': must be a positive integer (ranks per GPU)" >&2
    exit 2
fi
if [ $# -eq 0 ]; then
    echo "$0: no command after --" >&2
    echo "$usage" >&2
    exit 2
fi
if ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "$0: nvidia-cuda-mps-control is not on PATH: CUDA MPS is not installed here (it comes with the" \
         "NVIDIA driver's compute utilities)" >&2
    exit 2
fi

CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d "${TMPDIR:-/tmp}/ep_comm_mps_pipe.XXXXXX")
CUDA_MPS_LOG_DIRECTORY=$(mktemp -d "${TMPDIR:-/tmp}/ep_comm_mps_log.XXXXXX")
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / per_gpu))
EP_COMM_RANKS_PER_GPU=$per_gpu
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE EP_COMM_RANKS_PER_GPU

# shellcheck disable=SC2329  # the three functions below run from traps
daemon_answers() {  # the daemon of OUR pipe directory answers a query
    echo get_server_list | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1
}

daemon=''  # the control daemon's pid (our child)
# shellcheck disable=SC2329
stop_daemon() {  # EXIT trap: quit our daemon, wait for it to end (and reap it), say whether it is left
    local waited=0
    echo quit | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1 || true
    while kill -0 "$daemon" 2> /dev/null && [ "$waited" -lt 20 ]; do
        sleep 0.5
        waited=$((waited + 1))
    done
    if kill -0 "$daemon" 2> /dev/null; then
        echo "with_mps.sh: the MPS daemon at $CUDA_MPS_PIPE_DIRECTORY is still running; stop it with" \
             "CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY nvidia-cuda-mps-control <<< quit" \
             "(logs: $CUDA_MPS_LOG_DIRECTORY)" >&2
    else
        wait "$daemon" 2> /dev/null || true
        rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
        echo "with_mps.sh: MPS daemon stopped, none left at $CUDA_MPS_PIPE_DIRECTORY (logs: $CUDA_MPS_LOG_DIRECTORY)" >&2
    fi
}

child='' interrupted=0
GRACE_S=${WITH_MPS_GRACE_S:-10}  # after a signal, how long CMD's process group may take to end before KILL
# shellcheck disable=SC2329
pass_on() {  # INT/TERM/HUP trap: end CMD's whole process group; the main line then waits for it and exits
    interrupted=1
    # the group, or CMD alone while setsid has not made the group yet (a signal right after the start)
    [ -z "$child" ] || kill -s TERM -- "-$child" 2> /dev/null || kill -s TERM "$child" 2> /dev/null || true
}

nvidia-cuda-mps-control -f < /dev/null > "$CUDA_MPS_LOG_DIRECTORY/control.out" 2>&1 &
daemon=$!
waited=0
until daemon_answers; do  # up within 10 s, or gone
    if ! kill -0 "$daemon" 2> /dev/null || [ "$waited" -ge 20 ]; then
        echo "$0: nvidia-cuda-mps-control -f did not start (logs: $CUDA_MPS_LOG_DIRECTORY)" >&2
        kill "$daemon" 2> /dev/null || true
        rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
        exit 2
    fi
    sleep 0.5
    waited=$((waited + 1))
done
trap stop_daemon EXIT
trap pass_on INT TERM HUP
echo "with_mps.sh: MPS daemon at $CUDA_MPS_PIPE_DIRECTORY, $per_gpu rank(s) per GPU," \
     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" >&2

# CMD runs in the background, in a session (and process group) of its own, so that a trapped signal
# interrupts `wait` at once and reaches every process CMD started; after a signal, CMD's group gets
# GRACE_S seconds to end before it is killed, so that the EXIT trap always stops the daemon.
setsid "$@" <&0 &
child=$!
deadline=''
if [ "$interrupted" -eq 1 ]; then  # a signal came before $child was known (nothing was passed on): now
    pass_on
    deadline=$(( $(date +%s) + GRACE_S ))
fi
while :; do
    interrupted=0 rc=0
    if [ -z "$deadline" ]; then
        wait "$child" || rc=$?
        [ "$interrupted" -eq 1 ] || break
        deadline=$(( $(date +%s) + GRACE_S ))
    elif kill -0 "$child" 2> /dev/null && [ "$(date +%s)" -lt "$deadline" ]; then
        sleep 0.5
    else
        kill -s KILL -- "-$child" 2> /dev/null || true
        wait "$child" || rc=$?
        break
    fi
done
exit "$rc"
