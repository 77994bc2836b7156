#!/bin/bash
# call B: tests/gpu at 2 ranks (not forwarded), the repro at 2 and 1 ranks, then host time old vs new and the bench
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache
tar -xzf .gpu/nbcache.tgz -C /tmp
mkdir -p /tmp/mps /tmp/mpslog
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
nvidia-cuda-mps-control -d
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x NUMBA_CACHE_DIR -x EP_COMM_RANKS_PER_GPU -x NVSHMEM_REMOTE_TRANSPORT"
export NVSHMEM_REMOTE_TRANSPORT=none
mp() { # mp LIMIT TREE N CMD...: mpirun of CMD with TREE's ep_comm, under a time limit
  local lim=$1 tree=$2 n=$3; shift 3
  (cd $tree && PYTHONPATH=$tree:$KIT EP_COMM_RANKS_PER_GPU=$n timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np $n $FWD \
     $ROOT/launch/bind_gpu.sh "$@")
}
( cd $ROOT && PYTHONPATH=$ROOT:$KIT EP_COMM_RANKS_PER_GPU=2 timeout -k 10 330 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu --ranks 2 -k "not forwarded" -rA > /tmp/r/gputests.log 2>&1; echo "== gputests rc=$? at $(el)s" >> $S ) &
( for n in 2 1; do mp 150 $ROOT $n python3 $ROOT/.gpu/repro/idx_layout_between_calls.py > /tmp/r/repro$n.log 2>&1
    echo "== repro$n rc=$? at $(el)s: $(cat /tmp/r/repro$n.log | grep -a ok | tr '\n' ' ')" >> $S; done ) &
( mp 300 $ROOT/.gpu/old 1 python3 $ROOT/.gpu/hostprof.py --calls 20 --json /tmp/r/oldwarm.json > /tmp/r/oldwarm.log 2>&1
  echo "== oldwarm rc=$? at $(el)s" >> $S ) &
wait
echo quit | nvidia-cuda-mps-control; sleep 1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x EP_COMM_RANKS_PER_GPU -x NVSHMEM_REMOTE_TRANSPORT"
hp() { # hp TREE TAG
  mp 90 $1 1 python3 $ROOT/.gpu/hostprof.py --calls 1000 --json /tmp/r/hostprof-$2.json > /tmp/r/hostprof-$2.log 2>&1
  echo "== hostprof $2 rc=$? at $(el)s: $(grep -a p50 -m1 /tmp/r/hostprof-$2.log; tail -1 /tmp/r/hostprof-$2.log)" >> $S
}
for round in 1 2 3; do
  [ $(el) -lt 390 ] || break
  if [ $round = 2 ]; then hp $ROOT/.gpu/old old$round; hp $ROOT new$round; else hp $ROOT new$round; hp $ROOT/.gpu/old old$round; fi
done
bench() { # bench TREE TAG
  mp 60 $1 1 python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --config deepseek_v3_decode \
    --iters 50 --json /tmp/r/decode-1r-$2.json > /tmp/r/bench_$2.log 2>&1; echo "== bench $2 rc=$? at $(el)s" >> $S
}
[ $(el) -lt 420 ] && bench $ROOT new1 && bench $ROOT/.gpu/old old1
tar -czf $OUT/r.tgz -C /tmp r
cat $S
