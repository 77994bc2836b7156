#!/bin/bash
# session 14: session 13's callD2.sh with its old-tree warm-up fixed (mp 200 $OLD), then the decode bench bf16 and
# --fp8 (FP8 eager calls on the prepared path) old and new alternating. call D2: host time of single eager calls, old (29005de) and new tree
# alternating (tools/host_calls.py, both orders), the cProfile of tools/eager_profile.py in each tree, and
# launch/mpirun_gpu.sh (ca478ff) as the new tree's warm-up.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site OLD=$PWD/.gpu/old
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/r/gpu.txt
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT"
mp() { # mp LIMIT TREE CMD...: 1-rank mpirun of CMD with TREE's ep_comm
  local lim=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=$tree:$KIT timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np 1 $FWD "$@")
}
tree() { [ $1 = new ] && echo $ROOT || echo $OLD; }
( PYTHONPATH=$KIT timeout -k 5 200 launch/mpirun_gpu.sh 1 tools.host_calls --calls 20 --json /tmp/r/hc-newwarm.json \
    > /tmp/r/hc-newwarm.log 2>&1; echo "== mpirun_gpu.sh new warm rc=$? at $(el)s" >> $S ) &
( mp 200 $OLD python3 $ROOT/tools/host_calls.py --calls 20 --json /tmp/r/hc-oldwarm.json > /tmp/r/hc-oldwarm.log 2>&1
  echo "== old warm rc=$? at $(el)s" >> $S ) &
wait
hc() { # hc new|old TAG
  mp 60 $(tree $1) python3 $ROOT/tools/host_calls.py --calls 1000 --json /tmp/r/hc-$2.json > /tmp/r/hc-$2.log 2>&1
  echo "== host_calls $2 rc=$? at $(el)s load $(cut -d' ' -f1 /proc/loadavg)" >> $S
  tar -czf $OUT/r.tgz -C /tmp r
}
for step in "new n1" "old o1" "old o2" "new n2" "new n3" "old o3"; do
  [ $(el) -lt 170 ] || break
  hc $step
done
for t in new old; do
  [ $(el) -lt 215 ] || break
  mp 45 $(tree $t) python3 $ROOT/tools/eager_profile.py --calls 400 --top 40 > /tmp/r/prof-$t.log 2>&1
  echo "== eager_profile $t rc=$? at $(el)s" >> $S
  tar -czf $OUT/r.tgz -C /tmp r
done
bench() { # bench new|old TAG [extra]: the 1-rank decode bench (eager and graph figures, FP8 with --fp8)
  local t=$1 tag=$2; shift 2
  mp 60 $(tree $t) python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --config deepseek_v3_decode \
    --iters 30 --json /tmp/r/bench-$tag.json "$@" > /tmp/r/bench-$tag.log 2>&1
  echo "== bench $tag rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r
}
for step in "new fp8-n1 --fp8" "old fp8-o1 --fp8" "new bf16-n1" "old bf16-o1" "new fp8p-n1 --fp8 --config deepseek_v3_prefill" \
    "old fp8p-o1 --fp8 --config deepseek_v3_prefill" "old fp8-o2 --fp8" "new fp8-n2 --fp8"; do
  [ $(el) -lt 380 ] || break
  bench $step
done
cat $S; cat /tmp/r/gpu.txt
for f in /tmp/r/hc-*.log; do echo "--- $f"; tail -3 $f; done
