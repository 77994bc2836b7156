#!/bin/bash
# session 14 (session 13's next/targets46-47.sh, its results packed after each stage; the one copy kept). call E:
# issues 46/47's target figures on one GPU, one call: DeepEP v1.2.1 at 2 ranks under MPS (24 SMs) beside
# ep_comm.bench at 2 ranks (24 SMs), decode and prefill; 1 rank decode and prefill (bf16 and FP8); ncu profiles.
mkdir -p /tmp/r; source .device-kit/setup.sh > /tmp/r/setup.log 2>&1
ROOT=$PWD
export PYTHONPATH=$ROOT:$PYTHONPATH PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache NVSHMEM_REMOTE_TRANSPORT=none
[ -f .gpu/nbcache.tgz ] && tar -xzf .gpu/nbcache.tgz -C /tmp
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S=/tmp/r/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/r/gpu.txt
B="ep_comm.bench --backend nvshmem --no-baselines --no-busy-check"
# DeepEP alone first (its build is CPU-bound and its MPS daemon is its own): nothing else runs beside it
.device-kit/deepep/run.sh 2 24 /tmp/r/deepep.json > /tmp/r/deepep.log 2>&1; echo "== deepep rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r
# the kernels of this tree compiled once (1 rank), into NUMBA_CACHE_DIR, before the timed runs
[ -d /tmp/nbcache ] || { timeout -k 5 200 launch/mpirun_gpu.sh 1 $B --config deepseek_v3_decode --iters 2 > /tmp/r/warm.log 2>&1
  echo "== warm rc=$? at $(el)s" >> $S; }
b2() { # b2 CONFIG ITERS TAG [extra]
  local c=$1 n=$2 tag=$3; shift 3
  timeout -k 10 120 launch/with_mps.sh --ranks-per-gpu 2 -- launch/mpirun_gpu.sh 2 $B --num-sms 24 --config $c \
    --iters $n --json /tmp/r/b2-$tag.json "$@" > /tmp/r/b2-$tag.log 2>&1; echo "== b2 $tag rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r
}
b2 deepseek_v3_decode 50 decode
b2 deepseek_v3_prefill 30 prefill
for c in decode prefill; do
  [ $(el) -lt 430 ] || break
  timeout -k 5 90 launch/mpirun_gpu.sh 1 $B --config deepseek_v3_$c --iters 30 --json /tmp/r/b1-$c.json > /tmp/r/b1-$c.log 2>&1
  echo "== b1 $c rc=$? at $(el)s" >> $S
  timeout -k 5 90 launch/mpirun_gpu.sh 1 $B --config deepseek_v3_$c --iters 30 --fp8 --json /tmp/r/b1-$c-fp8.json > /tmp/r/b1-$c-fp8.log 2>&1
  echo "== b1 $c fp8 rc=$? at $(el)s" >> $S; tar -czf $OUT/r.tgz -C /tmp r
done
for c in decode prefill; do
  [ $(el) -lt 500 ] || break
  timeout -k 5 80 python3 -m ep_comm.bench.kernel_profile --config deepseek_v3_$c --out /tmp/r/ncu > /tmp/r/ncu-$c.log 2>&1
  echo "== ncu $c rc=$? at $(el)s" >> $S
done
tar -czf $OUT/r.tgz -C /tmp r
cat $S /tmp/r/gpu.txt; cat /tmp/r/deepep.log | tail -5
for f in /tmp/r/b2-*.log /tmp/r/b1-*.log; do echo "--- $f"; tail -12 $f; done
tail -20 /tmp/r/ncu-*.log
