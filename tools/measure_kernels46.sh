#!/usr/bin/env bash
# Issue 46, each kernel change before and after in one GPU call: `tools/measure_kernels46.sh [OUT_DIR]` from the repo
# root (after `source .device-kit/setup.sh`). Every variant switches changes back with the debug switches of
# ep_comm/kernels/switches.py and compiles into its own Numba cache (NUMBA_CACHE_DIR=CACHE_ROOT/VARIANT, CACHE_ROOT
# default OUT_DIR/cache: the variants' cache keys differ, and one index file per kernel would otherwise be rewritten
# by each). On the device tool, give OUT_DIR=$OUT and CACHE_ROOT=results/kernels46-cache (ignored by git, so kept on a
# warm machine between calls, and not sent back).
#
# Variants (VARIANTS="..." picks some; default: all):
#   old           every change switched back (the kernels of c0b50a8)
#   new           every change in
#   no_<change>   every change in but <change> (count_cut, one_fence, warp_fold, recv_loads, bounds, slots_in_rows,
#                 count_in_copy, count_apart): its share. slots_in_rows and count_in_copy change the decode chain
#                 (host side: which launches a new routing makes), so they show in the chain stage and in the time
#                 stage's "count + scatter (stable)" (slots_in_rows: one launch, not two) and "receive_counted
#                 (compact)" against "receive_count + copy (compact)" (count_in_copy: the backend's choice between
#                 the two, both timed in every variant); count_apart shows in "receive_counted (compact)"
#   regs80/regs64 every change in, the row kernels capped at 80 / 64 registers instead of 128
#   reduce128     every change in, the bf16 combine reduce at 128 registers (two blocks per SM; its default is 64
#                 since session 17, four blocks per SM)
#   count1024     every change in, the count one unit per warp at prefill too (EP_COMM_COUNT_MIN_WARPS=1024; host
#                 side only: it shares new's cache)
#   count16x1     every change in, the count at decode on one block of 16 warps, two warp steps each, no
#                 cross-block combine (EP_COMM_COUNT_MIN_WARPS=16 EP_COMM_COUNT_BLOCK_WARPS=16; shares new's cache)
#   pdl           every change in, plus programmatic dependent launch (EP_COMM_KERNEL_PDL=1): it only shows in a
#                 chain of launches, so give it to CHAIN_VARIANTS
# Stages (STAGES="..."; default: "warm time profile"):
#   warm     compile every variant at once, each in its own process (CPU-bound; one short bench run each)
#   time     python -m ep_comm.bench.kernels at T=128 (decode) and T=4096 (prefill) per variant, CUDA events
#   profile  python -m ep_comm.bench.kernel_profile (ncu: time, DRAM %, occupancy, registers) at decode and prefill,
#            for PROFILE_VARIANTS (default: "old new")
#   chain    the whole ops, one rank, graph replays: $CHAIN_CMD --config CONFIG --json ... at decode and prefill for
#            CHAIN_VARIANTS (default: "old new pdl"; not in the default STAGES: add it, e.g. STAGES="warm chain",
#            and list pdl in VARIANTS so that it is compiled in the warm stage)
# Then tools/compare_kernels46.py prints one table per shape (kernel x variant, p50 us) and the profiles side by side.
set -euo pipefail
OUT=${1:-results/kernels46}
ALL=count_cut,one_fence,warp_fold,recv_loads,bounds,slots_in_rows,count_in_copy,count_apart
VARIANTS=${VARIANTS:-"old new no_count_cut no_one_fence no_warp_fold no_recv_loads no_bounds no_slots_in_rows no_count_in_copy no_count_apart regs80 regs64 reduce128 count1024 count16x1"}
PROFILE_VARIANTS=${PROFILE_VARIANTS:-"old new"}
CHAIN_VARIANTS=${CHAIN_VARIANTS:-"old new pdl"}
CHAIN_CMD=${CHAIN_CMD:-"${PYTHON:-python3} -m ep_comm.bench --backend nvshmem --no-baselines --no-busy-check --iters 50"}
STAGES=${STAGES:-"warm time profile"}
ITERS=${ITERS:-50}
PY=${PYTHON:-python3}
CACHE_ROOT=${CACHE_ROOT:-$OUT/cache}
mkdir -p "$OUT"

legacy_of() {
  case "$1" in
    old) echo "$ALL" ;;
    new|regs80|regs64|reduce128|count1024|count16x1|pdl) echo "" ;;
    no_*) echo "${1#no_}" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
registers_of() {
  case "$1" in regs80) echo 80 ;; regs64) echo 64 ;; *) echo "" ;; esac
}
cache_of() {
  case "$1" in count1024|count16x1) echo new ;; *) echo "$1" ;; esac
}
count_warps_of() {
  case "$1" in count1024) echo 1024 ;; count16x1) echo 16 ;; *) echo "" ;; esac
}
count_block_warps_of() {
  case "$1" in count16x1) echo 16 ;; *) echo "" ;; esac
}
reduce_registers_of() {
  case "$1" in reduce128) echo 128 ;; *) echo "" ;; esac
}
pdl_of() {
  case "$1" in pdl) echo 1 ;; *) echo "" ;; esac
}
for v in $VARIANTS $PROFILE_VARIANTS $CHAIN_VARIANTS; do legacy_of "$v" > /dev/null; done  # unknown: exit 2

run_as() {  # run_as VARIANT COMMAND...: the command with the variant's switches and cache
  local v=$1; shift
  env EP_COMM_KERNEL_LEGACY="$(legacy_of "$v")" EP_COMM_KERNEL_MAX_REGISTERS="$(registers_of "$v")" \
      EP_COMM_KERNEL_REDUCE_MAX_REGISTERS="$(reduce_registers_of "$v")" \
      EP_COMM_COUNT_MIN_WARPS="$(count_warps_of "$v")" EP_COMM_COUNT_BLOCK_WARPS="$(count_block_warps_of "$v")" \
      EP_COMM_KERNEL_PDL="$(pdl_of "$v")" \
      NUMBA_CACHE_DIR="$CACHE_ROOT/$(cache_of "$v")" "$@"
}

if [[ " $STAGES " == *" warm "* ]]; then
  echo "== warm: compiling $VARIANTS"
  pids=()
  for v in $VARIANTS; do
    [[ "$(cache_of "$v")" == "$v" ]] || continue  # compiled by the variant whose cache it shares
    run_as "$v" "$PY" -m ep_comm.bench.kernels --tokens 128 --iters 1 --warmup 1 > "$OUT/warm_$v.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "a warm-up run failed (exit $?): see $OUT/warm_*.log"; done
fi

if [[ " $STAGES " == *" time "* ]]; then
  for v in $VARIANTS; do
    for t in 128 4096; do
      echo "== time: $v T=$t"
      run_as "$v" "$PY" -m ep_comm.bench.kernels --tokens "$t" --iters "$ITERS" --out "$OUT/kernels_${v}_T$t.json" \
        > "$OUT/kernels_${v}_T$t.log" 2>&1 || echo "failed: see $OUT/kernels_${v}_T$t.log"
    done
  done
fi

if [[ " $STAGES " == *" profile "* ]]; then
  for v in $PROFILE_VARIANTS; do
    for config in deepseek_v3_decode deepseek_v3_prefill; do
      echo "== profile: $v $config"
      run_as "$v" "$PY" -m ep_comm.bench.kernel_profile --config "$config" --out "$OUT/profile_$v" \
        > "$OUT/profile_${v}_$config.log" 2>&1 || echo "failed: see $OUT/profile_${v}_$config.log"
    done
  done
fi

if [[ " $STAGES " == *" chain "* ]]; then
  for v in $CHAIN_VARIANTS; do
    for config in deepseek_v3_decode deepseek_v3_prefill; do
      echo "== chain: $v $config"
      # shellcheck disable=SC2086
      run_as "$v" $CHAIN_CMD --config "$config" --json "$OUT/chain_${v}_$config.json" \
        > "$OUT/chain_${v}_$config.log" 2>&1 || echo "failed: see $OUT/chain_${v}_$config.log"
    done
  done
fi

"$PY" tools/compare_kernels46.py "$OUT"
