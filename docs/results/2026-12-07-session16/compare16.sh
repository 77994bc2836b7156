#!/bin/bash
# session 16: issue 51's last point and the kernels without Numba's runtime calls (4aa984b), old tree (29005de, in
# .gpu/old, its kernels with the calls: NUMBA_CUDA_ENABLE_NRT=1 as the kit sets it) against new, one rank,
# alternating on one machine: the 1-rank bench (eager calls, host per call, graph replays) at decode and prefill and
# tools/host_calls.py, in the order of STEPS. No step starts after LAST_START s (default 520). Logs under /tmp/r, packed into $OUT/r.tgz
# after each run.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site OLD=$PWD/.gpu/old
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
pack() { tar -czf $OUT/r.tgz -C /tmp r; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "NUMBA_CUDA_ENABLE_NRT=$NUMBA_CUDA_ENABLE_NRT"; } > /tmp/r/env.txt 2>&1
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT"
mp() { local lim=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=$tree:$KIT timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np 1 $FWD "$@"); }
tree() { [ $1 = new ] && echo $ROOT || echo $OLD; }
for t in old new; do  # both trees' kernels compiled side by side first
  ( mp 200 $(tree $t) python3 $ROOT/tools/host_calls.py --calls 20 --json /tmp/r/hc-${t}warm.json \
      > /tmp/r/hc-${t}warm.log 2>&1; echo "== $t warm rc=$? at $(el)s" >> $S ) &
done
wait; pack
hc() { mp 40 $(tree $1) python3 $ROOT/tools/host_calls.py --calls 1000 --json /tmp/r/hc-$2.json > /tmp/r/hc-$2.log 2>&1
  echo "== host_calls $2 rc=$? at $(el)s" >> $S; pack; }
bench() { local cfg=${3:-decode} it=50; [ $cfg = prefill ] && it=30
  mp 60 $(tree $1) python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check \
    --config deepseek_v3_$cfg --iters $it --json /tmp/r/bench-$cfg-$2.json > /tmp/r/bench-$cfg-$2.log 2>&1
  echo "== bench $cfg $2 rc=$? at $(el)s" >> $S; pack; }
DEFAULT="bench new n1,bench old o1,hc new n1,hc old o1,bench old o1 prefill,bench new n1 prefill,hc old o2,hc new n2,bench old o2,bench new n2,bench new n2 prefill,bench old o2 prefill"
IFS=, read -ra STEP <<< "${STEPS:-$DEFAULT}"
for step in "${STEP[@]}"; do [ $(el) -lt ${LAST_START:-520} ] || break; $step; done
cat $S /tmp/r/env.txt
for f in /tmp/r/bench-*.log; do echo "--- $f"; grep -aiE "graph|eager|host|replay" $f | head -14; done
for f in /tmp/r/hc-[no][0-9].log; do echo "--- $f"; tail -14 $f; done
