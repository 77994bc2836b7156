#!/bin/bash
# session 16, the GPU checks after the runtime-free kernels (4aa984b): the nvshmem contract suite (tests/mpi) at 1 and 2 ranks,
# stores and puts, under one MPS daemon (session 12's callA.sh), then tests/gpu at 2 ranks, the repro at 2 and 1
# ranks and tests/kernels, results packed under $OUT after each stage. KERNELS=0 leaves tests/kernels out, GPUTESTS=0
# tests/gpu; SUITES picks among the suites s2 p2 s1 p1 (default: all four).
mkdir -p /tmp/v; source .device-kit/setup.sh > /tmp/v/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site
export PYTHONPATH=$ROOT:$PYTHONPATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
mkdir -p /tmp/mps /tmp/mpslog $NUMBA_CACHE_DIR
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
nvidia-cuda-mps-control -d
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/v/summary.txt
pack() { tar -czf $OUT/v.tgz -C /tmp v; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; } > /tmp/v/env.txt 2>&1
suite() { # suite NAME RANKS TRANSPORT LIMIT [FILES]
  local name=$1 n=$2 tr=$3 lim=$4; shift 4
  timeout -k 10 $lim launch/mpirun_gpu.sh --ranks-per-gpu $n $n pytest -q -p no:cacheprovider -p no:xdist --with-mpi \
     --backend nvshmem --transport $tr --hypothesis-profile gpu -rfE --junitxml=/tmp/v/$name-rank{rank}.xml \
     ${@:-tests/mpi} > /tmp/v/$name.log 2>&1
  echo "== $name rc=$? at $(el)s: $(grep -aE '[0-9]+ (passed|failed)' /tmp/v/$name.log | tail -2 | tr '\n' ' ')" >> $S
}
suite warm 1 stores 200 tests/mpi/test_agreement.py; pack
[ "${KERNELS:-1}" = 0 ] || ( timeout -k 5 420 python3 -m pytest -q -p no:cacheprovider -x tests/kernels > /tmp/v/kernels.log 2>&1
  echo "== tests/kernels rc=$? at $(el)s: $(tail -1 /tmp/v/kernels.log)" >> $S ) &
suites=()
for name in ${SUITES:-s2 p2 s1 p1}; do  # s: stores, p: puts; the digit: ranks
  tr=stores; [ ${name:0:1} = p ] && tr=puts
  suite $name ${name:1} $tr 230 & suites+=($!)
done
wait "${suites[@]}"; pack
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x NUMBA_CACHE_DIR -x EP_COMM_RANKS_PER_GPU -x NVSHMEM_REMOTE_TRANSPORT"
[ "${GPUTESTS:-1}" = 0 ] || ( EP_COMM_RANKS_PER_GPU=2 timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/gpu --ranks 2 \
    -k "not forwarded" -rA > /tmp/v/gputests.log 2>&1; echo "== tests/gpu rc=$? at $(el)s: $(tail -1 /tmp/v/gputests.log)" >> $S ) &
( for n in 2 1; do
    EP_COMM_RANKS_PER_GPU=$n timeout -k 5 80 mpirun --oversubscribe --bind-to none -np $n $FWD launch/bind_gpu.sh \
      python3 .gpu/repro/idx_layout_between_calls.py > /tmp/v/repro$n.log 2>&1
    echo "== repro$n rc=$? at $(el)s: $(grep -a ok /tmp/v/repro$n.log | tr '\n' ' ')" >> $S; done ) &
wait
echo quit | nvidia-cuda-mps-control
cp /tmp/v/setup.log /tmp/v/setup.txt 2>/dev/null; pack
cat $S /tmp/v/env.txt
