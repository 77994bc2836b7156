#!/bin/bash
# call C: host time per eager call and the decode bench, old (29005de) and new tree alternating, 1 rank, no MPS
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
tar -xzf .gpu/nbcache.tgz -C /tmp
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT"
mp() { # mp LIMIT TREE CMD...: 1-rank mpirun of CMD with TREE's ep_comm, under a time limit
  local lim=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=$tree:$KIT timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np 1 $FWD "$@")
}
tree() { [ $1 = new ] && echo $ROOT || echo $ROOT/.gpu/old; }
hp() { # hp new|old TAG
  mp 90 $(tree $1) python3 $ROOT/.gpu/hostprof.py --calls 1000 --json /tmp/r/hostprof-$2.json > /tmp/r/hostprof-$2.log 2>&1
  echo "== hostprof $2 rc=$? at $(el)s load $(cut -d' ' -f1 /proc/loadavg)" >> $S
}
bench() { # bench new|old TAG
  mp 60 $(tree $1) python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --config deepseek_v3_decode \
    --iters 50 --json /tmp/r/decode-1r-$2.json > /tmp/r/bench_$2.log 2>&1
  echo "== bench $2 rc=$? at $(el)s load $(cut -d' ' -f1 /proc/loadavg)" >> $S
}
hp old oldwarm
for step in "bench old o1" "bench new n1" "hp new n1" "hp old o1" "bench new n2" "bench old o2" "hp old o2" "hp new n2" \
            "bench old o3" "bench new n3" "hp new n3" "hp old o3"; do
  set -- $step
  [ $(el) -lt 250 ] || break
  $1 $2 $3
done
tar -czf $OUT/r.tgz -C /tmp r
cat $S
