#!/bin/bash
# session 16, issue 46: do Numba's runtime calls cost the kernels time? (Run on a tree before 4aa984b: from it on the
# setting no longer reaches ep_comm's kernels.) With NUMBA_CUDA_ENABLE_NRT=1 (what
# launch/nvshmem.env and the device kit set) every array a kernel slices or passes on gets NRT_incref/NRT_decref
# calls (78 call sites in count_kernel's PTX, none with it 0); ep_comm's kernels allocate nothing on the device,
# so they need no runtime. Variants nrt1 (=1) and nrt0 (=0), each in its own Numba cache (the cache key does not hold
# the setting): the kernels on CUDA events (python -m ep_comm.bench.kernels, T=128 and 4096) in the order nrt1, nrt0,
# nrt0, nrt1; the 1-rank decode bench (graph replays and eager calls) nrt1, nrt0, nrt0, nrt1; Nsight Compute at decode
# for both. No step starts after 500 s. Logs under /tmp/n (tables by tools/compare_kernels46.py), packed into
# $OUT/n.tgz after each step.
mkdir -p /tmp/n; source .device-kit/setup.sh > /tmp/n/setup.log 2>&1
ROOT=$PWD
export PYTHONPATH=$ROOT:/tmp/site PYTHONUNBUFFERED=1 NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/n/summary.txt
pack() { tar -czf $OUT/n.tgz -C /tmp n; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/n/env.txt 2>&1
as() { local v=$1; shift; env NUMBA_CUDA_ENABLE_NRT=${v#nrt} NUMBA_CACHE_DIR=/tmp/nbcache${v#nrt} "$@"; }
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT"
for v in nrt1 nrt0; do
  ( as $v timeout -k 5 200 python3 -m ep_comm.bench.kernels --tokens 128 --iters 1 --warmup 1 > /tmp/n/warm_$v.log 2>&1
    echo "== warm $v rc=$? at $(el)s" >> $S ) &
done
wait; pack
kern() { for t in 128 4096; do
    as $1 timeout -k 5 60 python3 -m ep_comm.bench.kernels --tokens $t --iters 50 --out /tmp/n/kernels_$1${2}_T$t.json \
      > /tmp/n/kernels_$1${2}_T$t.log 2>&1; echo "== kernels $1$2 T=$t rc=$? at $(el)s" >> $S; done; pack; }
chain() { as $1 timeout -k 5 60 mpirun --oversubscribe --bind-to none -np 1 $FWD python3 -m ep_comm.bench --backend nvshmem \
    --no-baselines --no-busy-check --config deepseek_v3_decode --iters 50 --json /tmp/n/chain_$1$2.json \
    > /tmp/n/chain_$1$2.log 2>&1; echo "== chain $1$2 rc=$? at $(el)s" >> $S; pack; }
prof() { as $1 timeout -k 5 120 .device-kit/ncu/kernels.sh deepseek_v3_decode /tmp/n/ncu_$1 > /tmp/n/ncu_$1.log 2>&1
  echo "== ncu $1 rc=$? at $(el)s" >> $S; pack; }
STEPS=${STEPS:-"kern nrt1 a,kern nrt0 a,chain nrt1 a,chain nrt0 a,kern nrt0 b,kern nrt1 b,chain nrt0 b,chain nrt1 b,prof nrt0,prof nrt1"}
IFS=, read -ra STEP <<< "$STEPS"
for step in "${STEP[@]}"; do [ $(el) -lt 500 ] || break; $step; done
cat $S /tmp/n/env.txt
python3 tools/compare_kernels46.py /tmp/n 2>&1 | head -80
for f in /tmp/n/chain_*.log; do echo "--- $f"; grep -aE "graph|eager|host" $f | head -12; done
cat /tmp/n/ncu_*.log
