#!/bin/bash
# session 17, for the next device call: is the host time of an eager call bimodal by where its process runs? Session
# 17's runs put one process's host time per call at ~54 us and the next one's, same tree and setting, at ~78 (ranks47:
# a1 against a1b, p2a against p2b), and the 1-rank bench's at ~66 or ~92. Here: the machine's CPUs and the GPU's
# affinity, then tools/host_calls.py (new tree) pinned with taskset to one CPU at a time, twice per CPU, and unpinned
# four times with the CPU each process ran on; then the 1-rank decode bench, old tree (29005de) against new, each
# pinned to the same CPU, alternating three times (issue 51's last point without the placement); then
# tools/eager_timeline.py at decode, 1 rank and 2 ranks under MPS at 24 SMs (issue 47 item 1; it failed in session
# 17 on the poll's tag, fixed since). No step starts after LAST_START s (default 420). Logs under /tmp/p, packed
# into $OUT/p.tgz after each step.
mkdir -p /tmp/p; source .device-kit/setup.sh > /tmp/p/setup.log 2>&1
ROOT=$PWD KIT=/tmp/site OLD=$PWD/.gpu/old
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/p/summary.txt
pack() { tar -czf $OUT/p.tgz -C /tmp p; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m; lscpu; numactl -H 2>&1;
  cat /proc/cpuinfo | grep MHz; } > /tmp/p/machine.txt 2>&1
FWD="-x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NUMBA_CUDA_ENABLE_NRT -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x NUMBA_CACHE_DIR -x NVSHMEM_REMOTE_TRANSPORT -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x EP_COMM_RANKS_PER_GPU"
tree() { [ $1 = new ] && echo $ROOT || echo $OLD; }
# run LIMIT TREE CPU(or -) CMD...: one rank of TREE's ep_comm, pinned to CPU unless '-'; its main thread's CPU and the busiest threads (top -H) noted at 5 s
run() { local lim=$1 t=$(tree $2) cpu=$3; shift 3; local pin=""; [ "$cpu" = - ] || pin="taskset -c $cpu"
  (cd $t && PYTHONPATH=$t:$KIT timeout -k 5 $lim mpirun --oversubscribe --bind-to none -np 1 $FWD $pin "$@") &
  local job=$!; sleep 5; ps -eLo psr,comm,pid,tid | awk '$2 ~ /^python3/ && $3 == $4' > /tmp/p/psr.tmp
  top -H -b -n 1 -w 200 | head -30 > /tmp/p/top.tmp; wait $job; }
hc() { local t=$1 cpu=$2 tag=$3
  run 60 $t $cpu python3 $ROOT/tools/host_calls.py --calls 1000 --json /tmp/p/hc-$tag.json > /tmp/p/hc-$tag.log 2>&1
  echo "== hc $tag ($t, cpu $cpu) rc=$? at $(el)s: ran on $(awk '{print $1}' /tmp/p/psr.tmp | sort -u | tr '\n' ' ')" >> $S
  mv /tmp/p/top.tmp /tmp/p/top-$tag.txt; pack; }
bench() { local t=$1 cpu=$2 tag=$3
  run 60 $t $cpu python3 -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --config deepseek_v3_decode \
    --iters 50 --json /tmp/p/bench-$tag.json > /tmp/p/bench-$tag.log 2>&1
  echo "== bench $tag ($t, cpu $cpu) rc=$? at $(el)s: ran on $(awk '{print $1}' /tmp/p/psr.tmp | sort -u | tr '\n' ' ')" >> $S
  mv /tmp/p/top.tmp /tmp/p/top-$tag.txt; pack; }
for t in old new; do  # both trees' kernels compiled first, side by side
  ( run 200 $t - python3 $ROOT/tools/host_calls.py --calls 20 --json /tmp/p/warm-$t.json > /tmp/p/warm-$t.log 2>&1
    echo "== warm $t rc=$? at $(el)s" >> $S ) &
done
wait; pack
STEPS=${STEPS:-"hc new 2 c2a,hc new 9 c9a,hc new 2 c2b,hc new 9 c9b,hc new 14 c14a,hc new 14 c14b,hc new - u1,hc new - u2,hc new - u3,hc new - u4,bench new 2 n1,bench old 2 o1,bench old 2 o2,bench new 2 n2,bench new 2 n3,bench old 2 o3"}
IFS=, read -ra STEP <<< "$STEPS"
for step in "${STEP[@]}"; do [ $(el) -lt ${LAST_START:-420} ] || break; $step; done
tl() { local n=$1 tag=$2; shift 2; [ $(el) -lt ${LAST_START:-420} ] || return
  timeout -k 5 90 mpirun --oversubscribe --bind-to none -np $n $FWD launch/bind_gpu.sh python3 tools/eager_timeline.py \
    --out /tmp/p/$tag --tokens 128 --iters 30 "$@" > /tmp/p/$tag.log 2>&1
  echo "== timeline $tag rc=$? at $(el)s" >> $S; pack; }
export PYTHONPATH=$ROOT:$KIT
tl 1 tl1  # no MPS
mkdir -p /tmp/mpsp /tmp/mpslogp
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mpsp CUDA_MPS_LOG_DIRECTORY=/tmp/mpslogp EP_COMM_RANKS_PER_GPU=2
nvidia-cuda-mps-control -d; tl 2 tl2 --num-sms 24; echo quit | nvidia-cuda-mps-control
cat $S; grep -aE "^(alone|round)" /tmp/p/hc-*.log | head -40
for f in /tmp/p/bench-*.log; do echo "--- $f"; grep -aE "host time|CUDA graph replay, GPU|eager cached" $f; done
cat /tmp/p/tl1/timeline.txt /tmp/p/tl2/timeline.txt 2>/dev/null | head -80
