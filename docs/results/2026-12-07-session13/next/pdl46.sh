#!/bin/bash
# call F: programmatic dependent launch (EP_COMM_KERNEL_PDL=1) against the default, 1 rank, graph replays and eager
# calls of the bench, decode then prefill (tools/measure_kernels46.sh's pdl variant, chain stage), in one call.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONUNBUFFERED=1 NVSHMEM_REMOTE_TRANSPORT=none PYTHONPATH=$ROOT:$KIT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/r/gpu.txt
export CACHE_ROOT=/tmp/k46 VARIANTS="new pdl" CHAIN_VARIANTS="new pdl" ITERS=30
STAGES=warm timeout 120 tools/measure_kernels46.sh /tmp/r/k46 > /tmp/r/k46-warm.log 2>&1; echo "== warm rc=$? at $(el)s" >> $S
B="python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --iters 30"
for c in decode prefill decode; do
  [ $(el) -lt 150 ] || break
  for v in new pdl; do
    ( [ $v = pdl ] && export EP_COMM_KERNEL_PDL=1; NUMBA_CACHE_DIR=/tmp/k46/$v timeout 40 $B --config deepseek_v3_$c \
        --json /tmp/r/$v-$c-$(el).json > /tmp/r/$v-$c-$(el).log 2>&1; echo "== $v $c rc=$? at $(el)s" >> $S )
  done
  tar -czf $OUT/r.tgz -C /tmp r
done
cat $S /tmp/r/gpu.txt
for f in /tmp/r/*-de*.log /tmp/r/*-pre*.log; do echo "--- $f"; grep -aE "\[ep_comm.bench\]|eager cached|host time per|CUDA graph replay, GPU" $f | cut -c1-400; done
