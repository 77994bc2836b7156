#!/bin/bash
# call A: the nvshmem contract suite (tests/mpi) at 1 and 2 ranks, stores and puts, under one MPS daemon
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/setup.log 2>&1
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache
mkdir -p /tmp/r /tmp/mps /tmp/mpslog $NUMBA_CACHE_DIR
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
nvidia-cuda-mps-control -d
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
{ nvidia-smi -L; git log --oneline -1 2>/dev/null; python3 -c "import numba, numba_cuda, cupy; print(numba.__version__, numba_cuda.__version__, cupy.__version__)"; } > /tmp/r/env.txt 2>&1
suite() { # suite NAME RANKS TRANSPORT LIMIT [FILES]
  local name=$1 n=$2 tr=$3 lim=$4; shift 4
  timeout -k 10 $lim launch/mpirun_gpu.sh --ranks-per-gpu $n $n pytest -q -p no:cacheprovider -p no:xdist --with-mpi \
     --backend nvshmem --transport $tr --hypothesis-profile gpu -rfE --junitxml=/tmp/r/$name-rank{rank}.xml \
     ${@:-tests/mpi} > /tmp/r/$name.log 2>&1
  echo "== $name rc=$? at $(el)s: $(grep -E '[0-9]+ (passed|failed)' /tmp/r/$name.log | tail -2 | tr '\n' ' ')" >> /tmp/r/summary.txt
}
suite warm 1 stores 230 tests/mpi/test_agreement.py
du -sh $NUMBA_CACHE_DIR >> /tmp/r/summary.txt
left=$(( 565 - $(el) ))
suite s2 2 stores $left &
suite p2 2 puts $left &
suite s1 1 stores $left &
suite p1 1 puts $left &
wait
echo quit | nvidia-cuda-mps-control
tar -czf $OUT/nbcache.tgz -C /tmp nbcache 2>/dev/null; ls -la $OUT/nbcache.tgz >> /tmp/r/summary.txt
cp /tmp/setup.log /tmp/r/; tar -czf $OUT/r.tgz -C /tmp r
cat /tmp/r/summary.txt
