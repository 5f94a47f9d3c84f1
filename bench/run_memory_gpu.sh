#!/usr/bin/env bash
# The activation-memory checks of one GPU call, by part (each fits one device call of 10 minutes):
#
#     bash bench/run_memory_gpu.sh OUT tests          # the activations GPU tests (~60 s)
#     bash bench/run_memory_gpu.sh OUT context        # longest context, 8B, 80 GiB cap, 4 layers standing for 32:
#                                                     # frozen + Liger, sits + Liger, PEFT, PEFT + checkpointing, and
#                                                     # offloaded + tiles up to the plan's 12x point (~6 min)
#     bash bench/run_memory_gpu.sh OUT context-rest   # tokens/s of the checkpointed arms at one length, 36,864 (~2 min)
#     bash bench/run_memory_gpu.sh OUT context-full   # the offloaded arm at 409,600 tokens on all 32 layers (one
#                                                     # step, ~8 min: the host side of 32 layers, ~100 GiB pinned)
#     bash bench/run_memory_gpu.sh OUT gate           # regress.py's memory arms on both shapes (~300 s)
#     bash bench/run_memory_gpu.sh OUT profile        # 1B sits + Liger, inputs rebuilt vs saved, under the profiler:
#                                                     # is the rebuild's cost kernel time or the GPU waiting (~90 s)
#
# Several parts run in order (bash bench/run_memory_gpu.sh OUT tests gate). Wheels the GPU image lacks
# (liger-kernel) travel in .whl/ and are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash bench/run_memory_gpu.sh OUT {tests|context|context-rest|context-full|gate|profile} ..." >&2
    exit 2
fi
OUT="$1"; shift
mkdir -p "$OUT"
. bench/gpu_env.sh
free -g | head -n 2
status=0
for part in "$@"; do
    case "$part" in
        tests)
            python3 -m pytest -q -p no:logging -rfE --tb=short -m gpu tests/activations > "$OUT/tests.log" 2>&1 || status=1
            grep -E "passed|failed|^E " "$OUT/tests.log" | tail -n 12 ;;
        context)
            python3 bench/longest_context.py --measure --model 8b --layers 4 --max-tokens 450560 \
                --arms frozen+liger sits+liger peft peft+gc sits+liger+offload \
                --probe-timeout 200 --arm-timeout 330 --out "$OUT/context" || status=1 ;;
        context-rest)
            python3 bench/longest_context.py --measure --model 8b --layers 4 --max-tokens 36864 \
                --arms peft+gc sits+liger+gc sits+liger+offload \
                --probe-timeout 30 --arm-timeout 90 --out "$OUT/context_same_length" || status=1 ;;
        context-full)
            python3 bench/longest_context.py --measure --model 8b --arms sits+liger+offload \
                --max-tokens 409600 --probe-timeout 560 --arm-timeout 580 --out "$OUT/context_full" || status=1 ;;
        gate)
            python3 bench/regress.py --out "$OUT/regress" --shapes 8b 1b --no-graph-breaks --arm-timeout 130 \
                --arms frozen+compile frozen+liger peft+compile sits sits+compile sits+liger sits+liger+saved \
                sits+fp8+liger 2>&1 | grep --line-buffered -v -E "^W[0-9]{4}|Warning|warnings.warn" \
                | tee "$OUT/regress.log" || status=1 ;;
        profile)
            python3 bench/profile_rebuild.py --out "$OUT/profile_rebuild" 2>&1 | grep -v -E "USDT|Warning" || status=1 ;;
        *)
            echo "unknown part: $part (tests, context, context-rest, context-full, gate, profile)" >&2
            status=2 ;;
    esac
done
exit "$status"
