#!/bin/bash
# session 14, the last device call (what verify.sh's limits cut, and issue 51's host time): tests/gpu at 2 ranks
# under MPS, then the host-time and bench comparisons old (29005de) against new (session 13's callD2.sh without its
# cProfile stage), every stage bounded so that the call ends inside the session's device time left.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
mkdir -p /tmp/mps /tmp/mpslog
( export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; nvidia-cuda-mps-control -d
  PYTHONPATH=$ROOT:$KIT EP_COMM_RANKS_PER_GPU=2 timeout -k 10 230 python3 -m pytest -q -p no:cacheprovider tests/gpu \
    --ranks 2 -k "not forwarded" -rA > /tmp/r/gputests.log 2>&1
  echo "== tests/gpu rc=$? at $(el)s: $(grep -aE 'passed|failed' /tmp/r/gputests.log | tail -1)" >> $S
  echo quit | nvidia-cuda-mps-control ) &
OLD=$PWD/.gpu/old
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT"
mp() { local lim=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=$tree:$KIT timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np 1 $FWD "$@"); }
tree() { [ $1 = new ] && echo $ROOT || echo $OLD; }
# both trees' kernels compiled meanwhile (CPU-bound, beside the GPU tests); timed runs start after the tests
( mp 200 $OLD python3 $ROOT/tools/host_calls.py --calls 20 --json /tmp/r/hc-oldwarm.json > /tmp/r/hc-oldwarm.log 2>&1
  echo "== old warm rc=$? at $(el)s" >> $S ) &
( mp 200 $ROOT python3 $ROOT/tools/host_calls.py --calls 20 --json /tmp/r/hc-newwarm.json > /tmp/r/hc-newwarm.log 2>&1
  echo "== new warm rc=$? at $(el)s" >> $S ) &
wait; tar -czf $OUT/r.tgz -C /tmp r
hc() { mp 40 $(tree $1) python3 $ROOT/tools/host_calls.py --calls 1000 --json /tmp/r/hc-$2.json > /tmp/r/hc-$2.log 2>&1
  echo "== host_calls $2 rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r; }
bench() { local t=$1 tag=$2; shift 2
  mp 45 $(tree $t) python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --config deepseek_v3_decode \
    --iters 30 --json /tmp/r/bench-$tag.json "$@" > /tmp/r/bench-$tag.log 2>&1
  echo "== bench $tag rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r; }
# HC_STEPS: the host-time runs in order, "new TAG" or "old TAG" each (default: this session's four)
IFS=, read -ra HC <<< "${HC_STEPS:-new n1,old o1,old o2,new n2}"
for step in "${HC[@]}"; do [ $(el) -lt 330 ] || break; hc $step; done
for step in "new fp8-n1 --fp8" "old fp8-o1 --fp8" "new bf16-n1" "old bf16-o1"; do [ $(el) -lt 400 ] || break; bench $step; done
cat $S; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for f in /tmp/r/hc-[no][0-9].log; do echo "--- $f"; tail -14 $f; done
