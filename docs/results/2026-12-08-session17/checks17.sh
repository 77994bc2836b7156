#!/bin/bash
# session 17: the GPU checks that combo16.sh leaves out, after the runtime-free kernels (4aa984b): tests/kernels and
# tests/gpu at 2 ranks under MPS, side by side. Logs under /tmp/k, packed into $OUT/k.tgz.
mkdir -p /tmp/k; source .device-kit/setup.sh > /tmp/k/setup.log 2>&1
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
mkdir -p /tmp/mpsk /tmp/mpslogk $NUMBA_CACHE_DIR
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/k/summary.txt
( timeout -k 5 ${KLIM:-500} python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels > /tmp/k/kernels.log 2>&1
  echo "== tests/kernels rc=$? at $(el)s: $(tail -1 /tmp/k/kernels.log)" >> $S; tar -czf $OUT/k.tgz -C /tmp k ) &
( export CUDA_MPS_PIPE_DIRECTORY=/tmp/mpsk CUDA_MPS_LOG_DIRECTORY=/tmp/mpslogk; nvidia-cuda-mps-control -d
  EP_COMM_RANKS_PER_GPU=2 timeout -k 10 ${GLIM:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu --ranks 2 \
    -k "not forwarded" -rA > /tmp/k/gputests.log 2>&1; echo "== tests/gpu rc=$? at $(el)s: $(tail -1 /tmp/k/gputests.log)" >> $S
  echo quit | nvidia-cuda-mps-control; tar -czf $OUT/k.tgz -C /tmp k ) &
wait; tar -czf $OUT/k.tgz -C /tmp k
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat $S; grep -aE "passed|failed|error" /tmp/k/kernels.log | tail -5
