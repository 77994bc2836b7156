#!/bin/bash
# session 15, issue 47 item 3 (why a call's host time at 2 ranks under MPS is ~2x one rank's): tools/host_calls.py
# (new tree only) in five settings on one GPU, each its own process(es): a1 one rank; m1 one rank under MPS (50 % of
# the SMs); p2 two independent one-rank jobs at once under MPS (two processes, no peer: CPU and GPU sharing only);
# d2 one job of two ranks under MPS (peers: the R=2 work and the waits); a1b one rank again (drift). During p2 and
# d2, the busiest threads (top -H). Then tools/eager_timeline.py at decode, 1 rank (tl1) and 2 ranks under MPS at 24
# SMs (tl2). Logs under /tmp/r, packed into $OUT/r.tgz after each stage.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONPATH=$ROOT:$KIT PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary47.txt
pack() { tar -czf $OUT/r.tgz -C /tmp r; }
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x EP_COMM_RANKS_PER_GPU"
hc() { local n=$1 tag=$2
  timeout -k 5 90 mpirun --oversubscribe --bind-to none -np $n $FWD launch/bind_gpu.sh python3 tools/host_calls.py \
    --calls 1000 --json /tmp/r/hc47-$tag.json > /tmp/r/hc47-$tag.log 2>&1
  echo "== $tag ($n ranks) rc=$? at $(el)s" >> $S; }
threads() { sleep 25; top -H -b -n 1 -w 200 | head -30 > /tmp/r/top-$1.txt; }
hc 1 a1; pack
mkdir -p /tmp/mps47 /tmp/mpslog47
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps47 CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog47 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
export EP_COMM_RANKS_PER_GPU=2
nvidia-cuda-mps-control -d
hc 1 m1; pack
threads p2 & hc 1 p2a & hc 1 p2b & wait; pack
threads d2 & hc 2 d2; wait; pack
tl() { local n=$1 tag=$2; shift 2
  timeout -k 5 90 mpirun --oversubscribe --bind-to none -np $n $FWD launch/bind_gpu.sh python3 tools/eager_timeline.py \
    --out /tmp/r/$tag --tokens 128 --iters 30 "$@" > /tmp/r/$tag.log 2>&1
  echo "== timeline $tag rc=$? at $(el)s" >> $S; pack; }
tl 2 tl2 --num-sms 24
echo quit | nvidia-cuda-mps-control
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
hc 1 a1b; pack
tl 1 tl1
cat $S; cat /tmp/r/tl1/timeline.txt /tmp/r/tl2/timeline.txt 2>/dev/null | head -120; for f in /tmp/r/hc47-*.log; do echo "--- $f"; grep -aE "^(rank [0-9] )?(alone|round)" $f; done
