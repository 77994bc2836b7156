#!/usr/bin/env bash
# GPU self-test of one node: the kernel tests on the GPU, the kernel timings, the contract suites on
# the nvshmem backend with 1 and 2 ranks (peer stores and nvshmem puts) and the GPU tests. Each step's
# output goes to one log; a summary line per step is printed. Exit status: number of failed steps.
#
#   launch/gpu_selftest.sh [OUT_DIR [STEP[:SECONDS]...]]   (default: results/selftest, every step)
#
# Steps: bench-prefill bench-decode kernel-bench contract-stores contract-puts kernels gpu-tests soak
#        create-close determinism examples
#
# On the device machines: source .device-kit/setup.sh first.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/results/selftest}
shift || true
steps=${*:-bench-prefill bench-decode kernel-bench contract-stores contract-puts kernels gpu-tests soak create-close determinism examples}
mkdir -p "$out"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# one kernel cache for every step and rank; the randomized contract test at a GPU-sized example count
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/ep_comm_numba_cache} EP_COMM_RANDOMIZED_EXAMPLES=${EP_COMM_RANDOMIZED_EXAMPLES:-20}
log="$out/selftest.log"
: > "$log"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...   (a STEP:SECONDS argument overrides TIMEOUT_S)
    local name=$1 limit=${override:-$2} start rc first
    shift 2
    start=$(date +%s) first=$(wc -l < "$log")
    echo "===== $name: $*" >> "$log"
    timeout -k 5 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # mpirun's ranks can outlive a killed launcher: end them
        pkill -9 -f 'mpirun|orted|python3 -m (ep_comm|pytest|examples)' 2>/dev/null
        sleep 1
    fi
    [ $rc -eq 0 ] || failed=$((failed + 1))
    printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
        "$(tail -n +$((first + 1)) "$log" | grep -E '[0-9]+ (passed|failed)' | tail -1)" | tee -a "$log"
}

for item in $steps; do
    name=${item%%:*} override=
    [ "$item" = "$name" ] || override=${item#*:}
    case $name in
        bench-prefill) step "$name" 150 launch/mpirun_gpu.sh 2 ep_comm.bench --config deepseek_v3_prefill \
                           --iters 50 --warmup 5 --json "$out/prefill.json" --plot "$out/prefill.png" ;;
        bench-decode) step "$name" 90 launch/mpirun_gpu.sh 2 ep_comm.bench --config deepseek_v3_decode \
                          --iters 200 --warmup 10 --json "$out/decode.json" ;;
        kernel-bench) step "$name" 120 python3 -m ep_comm.bench.kernels --out "$out/kernels.json" ;;
        contract-stores) step "$name" 360 env EP_COMM_TEST_BACKEND=nvshmem EP_COMM_NVSHMEM_PUTS=0 \
                             python3 -m pytest -q -p no:cacheprovider tests/test_multirank.py -k "${CONTRACT_RANKS:-1 or 2}" ;;
        contract-puts) step "$name" 360 env EP_COMM_TEST_BACKEND=nvshmem EP_COMM_NVSHMEM_PUTS=1 \
                           python3 -m pytest -q -p no:cacheprovider tests/test_multirank.py -k "${CONTRACT_RANKS:-1 or 2}" ;;
        kernels) step "$name" 240 python3 -m pytest -q -p no:cacheprovider tests/kernels ;;
        gpu-tests) step "$name" 300 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
        soak) step "$name" 240 launch/mpirun_gpu.sh 2 ep_comm.soak --backend nvshmem --iters "${SOAK_ITERS:-10000}" \
                  --check-every 100 --create-close 0 --json "$out/soak.json" ;;
        create-close) step "$name" 150 launch/mpirun_gpu.sh 2 ep_comm.soak --backend nvshmem --iters 0 \
                          --create-close 100 --json "$out/create_close.json" ;;
        determinism) step "$name" 180 launch/mpirun_gpu.sh 2 ep_comm.soak --backend nvshmem --iters 0 \
                         --create-close 0 --repeat-deterministic 100 --json "$out/determinism.json" ;;
        examples) step "$name" 180 sh -c 'launch/mpirun_gpu.sh 2 examples.moe_layer --dtype bfloat16 --tokens 4096 \
                      --hidden 2048 --ffn 1024 --experts 32 --topk 8 --alignment 128 &&
                      launch/mpirun_gpu.sh 2 examples.torch_moe_layer --dtype bfloat16' ;;
        *) echo "unknown step $name" >&2; failed=$((failed + 1)) ;;
    esac
done
exit $failed
