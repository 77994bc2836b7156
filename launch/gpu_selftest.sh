#!/usr/bin/env bash
# GPU self-test of one node: the kernel tests on the GPU, the kernel timings, the contract suites on
# the nvshmem backend (peer stores and nvshmem puts), the GPU tests, the benchmarks, the soak, the
# determinism repeats, Buffer create/close cycles and the examples. Each step's output goes to one
# log; a summary line per step is printed. Exit status: number of failed steps (2 for bad options).
#
#   launch/gpu_selftest.sh [--ranks LIST] [--mps] [OUT_DIR [STEP[:SECONDS]...]]
#   launch/gpu_selftest.sh --ranks 2,4,8 --mps results/one_gpu      # every step at 2, 4, 8 ranks on one GPU
#
# On the device machines: source .device-kit/setup.sh first.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/gpu_selftest.sh [-h|--help] [--ranks LIST] [--mps] [OUT_DIR [STEP[:SECONDS]...]]

  OUT_DIR         logs and results (default: results/selftest); selftest.log holds every step's output
  STEP[:SECONDS]  the steps to run (default: all, in this order), SECONDS overrides a step's time limit:
                  bench-prefill bench-decode kernel-bench kernel-sms contract-stores contract-puts kernels gpu-tests
                  soak create-close determinism examples (moe_layer, moe_overlap with
                  OUT_DIR/examples-overlap-Nranks.json, torch_moe_layer)
  --ranks LIST    rank counts of the multi-rank steps, comma-separated (default: 2). The bench, soak,
                  create-close, determinism and examples steps run once per count (NAME@N, results
                  OUT_DIR/NAME-Nranks.json, time limits scaled by N/2 above 2 ranks); the contract suites
                  run at 1 and LIST ranks, the GPU tests at LIST ranks.
  --mps           every multi-rank step puts all its ranks on one GPU (the first visible) under its own
                  CUDA MPS daemon (launch/with_mps.sh --ranks-per-gpu N; needs root). Without it each
                  rank needs its own GPU. Figures of ranks sharing a GPU are not NVLink figures.
  -h, --help      this text

Each step runs in its own session (setsid) under a time limit; when it ends, times out or the self-test
is interrupted, whatever is left of that session is killed, and nothing else.
EOF
}

ranks=2 mps=0
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --ranks) ranks=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
        --mps) mps=1; shift ;;
        --) shift; break ;;
        -*) echo "gpu_selftest.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if ! [[ "$ranks" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]]; then
    echo "gpu_selftest.sh: --ranks '$ranks': must be a comma-separated list of positive integers, e.g. 2,4,8" >&2
    exit 2
fi
IFS=, read -r -a rank_counts <<< "$ranks"
max_ranks=$(printf '%s\n' "${rank_counts[@]}" | sort -n | tail -1)
contract_ranks=$ranks
[[ ",$ranks," == *",1,"* ]] || contract_ranks="1,$ranks"

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/results/selftest}
[ $# -eq 0 ] || shift
steps=${*:-bench-prefill bench-decode kernel-bench kernel-sms contract-stores contract-puts kernels gpu-tests soak create-close determinism examples}
mkdir -p "$out"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/ep_comm_numba_cache}  # one kernel cache for every step and rank
log="$out/selftest.log"
: > "$log"
failed=0
own_session=$(ps -o sid= -p $$ | tr -d ' ')
session=  # the running step's session id (= its leader's pid: setsid in a child of this shell does not fork)

end_session() {  # end_session SIGNAL: signal every process left in the running step's session
    if [ -n "$session" ] && [ "$session" != "$own_session" ]; then
        pkill -"$1" -s "$session" 2> /dev/null || true
    fi
}

# shellcheck disable=SC2329  # runs from the trap
interrupted() {
    end_session TERM
    sleep 5
    end_session KILL
    echo "gpu_selftest.sh: interrupted; the running step's processes were ended" >&2
    exit 130
}
trap interrupted INT TERM

step() {  # step NAME TIMEOUT_S COMMAND...   (a STEP:SECONDS argument overrides TIMEOUT_S)
    local name=$1 limit=${override:-$2} start first rc=0
    shift 2
    start=$(date +%s) first=$(wc -l < "$log")
    echo "===== $name: $*" >> "$log"
    setsid timeout -k 30 "$limit" "$@" >> "$log" 2>&1 < /dev/null &
    session=$!
    wait "$session" || rc=$?
    end_session KILL  # ranks or launchers that outlived the step (e.g. after a timeout)
    session=
    [ $rc -eq 0 ] || failed=$((failed + 1))
    printf '%-20s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
        "$(tail -n +$((first + 1)) "$log" | grep -E '[0-9]+ (passed|failed)' | tail -1 || true)" | tee -a "$log"
}

mps_prefix() {  # mps_prefix N: the with_mps.sh words for N ranks on one GPU (none without --mps)
    prefix=()
    if [ "$mps" -eq 1 ]; then
        prefix=(launch/with_mps.sh --ranks-per-gpu "$1" --)
    fi
}

at_each_count() {  # at_each_count NAME TIMEOUT_S MODULE [ARGS...]: MODULE on N ranks for every N of --ranks
    local name=$1 limit=$2 n
    shift 2
    for n in "${rank_counts[@]}"; do
        mps_prefix "$n"
        step "$name@$n" $((limit * (n > 2 ? n : 2) / 2)) "${prefix[@]}" launch/mpirun_gpu.sh "$n" "${@//%N%/$n}"
    done
}

suite() {  # suite NAME TIMEOUT_S PYTEST_ARGS...: a pytest run whose jobs start their own ranks
    local name=$1 limit=$2
    shift 2
    mps_prefix "$max_ranks"
    step "$name" "$limit" "${prefix[@]}" python3 -m pytest -q -p no:cacheprovider "$@"
}

contract() {  # contract NAME TRANSPORT: the contract suites on the nvshmem backend
    suite "$1" 360 tests/jobs/test_multirank.py --backend nvshmem --transport "$2" --ranks "$contract_ranks" \
        --hypothesis-profile gpu
}

for item in $steps; do
    name=${item%%:*} override=
    [ "$item" = "$name" ] || override=${item#*:}
    case $name in
        bench-prefill) at_each_count "$name" 150 ep_comm.bench --config deepseek_v3_prefill --iters 50 --warmup 5 \
                           --json "$out/bench-prefill-%N%ranks.json" --plot "$out/bench-prefill-%N%ranks.png" ;;
        bench-decode) at_each_count "$name" 90 ep_comm.bench --config deepseek_v3_decode --iters 200 --warmup 10 \
                          --json "$out/bench-decode-%N%ranks.json" ;;
        kernel-bench) step "$name" 120 python3 -m ep_comm.bench.kernels --out "$out/kernel-bench.json" ;;
        kernel-sms) step "$name" 400 python3 -m ep_comm.bench.kernels --sms 16,24,32,66,all --pair \
                        --out "$out/kernel-sms.json" ;;
        contract-stores) contract "$name" stores ;;
        contract-puts) contract "$name" puts ;;
        kernels) step "$name" 240 python3 -m pytest -q -p no:cacheprovider tests/kernels ;;
        gpu-tests) suite "$name" 300 tests/gpu --ranks "$ranks" ;;
        soak) at_each_count "$name" 240 ep_comm.soak --backend nvshmem --iters "${SOAK_ITERS:-10000}" \
                  --check-every 100 --create-close 0 --json "$out/soak-%N%ranks.json" ;;
        create-close) at_each_count "$name" 150 ep_comm.soak --backend nvshmem --iters 0 --create-close 100 \
                          --json "$out/create-close-%N%ranks.json" ;;
        determinism) at_each_count "$name" 180 ep_comm.soak --backend nvshmem --iters 0 --create-close 0 \
                         --repeat-deterministic 100 --json "$out/determinism-%N%ranks.json" ;;
        examples) at_each_count "$name" 120 examples.moe_layer --dtype bfloat16 --tokens 4096 --hidden 2048 \
                      --ffn 1024 --experts 32 --topk 8 --alignment 128
                  at_each_count "$name-overlap" 120 examples.moe_overlap --dtype bfloat16 --tokens 4096 --hidden 2048 \
                      --ffn 1024 --experts 32 --topk 8 --alignment 128 --json "$out/examples-overlap-%N%ranks.json"
                  at_each_count "$name-torch" 60 examples.torch_moe_layer --dtype bfloat16 ;;
        *) echo "unknown step $name" | tee -a "$log" >&2; failed=$((failed + 1)) ;;
    esac
done
exit $failed
