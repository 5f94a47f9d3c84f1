#!/usr/bin/env bash
# The 4-bit bases' GPU measurements in one device call (~9 min): the kernels alone (bench_int4.py: dequantization
# bandwidth, fused dequant-GEMM against dequantize + cuBLAS by token count), one layer against the bf16 path and
# PEFT's QLoRA layer (bench_layer.py), where the INT4 layer's time goes (profile_layer.py), and the 4-bit arms on
# all 32 layers of the 8B shape (regress.py --shapes 8b-full). Wheels the GPU image lacks (liger-kernel, gguf,
# bitsandbytes) travel in .whl/ (bench/gpu_env.sh installs them).
#
#     bash bench/run_int4_gpu.sh OUT            # PACK=1: everything in one OUT.tgz at the end
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash bench/run_int4_gpu.sh OUT}"
mkdir -p "$OUT"
. bench/gpu_env.sh
trap pack EXIT
quiet() { grep --line-buffered -v -E "Warning|warn|^W[0-9]{4}"; }
status=0
if [ "${INT4_TESTS:-1}" = 1 ]; then  # the 4-bit bases' GPU tests first: a failure there explains what follows
    timeout 120 python3 -m pytest -q -m gpu tests/int4 -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
    tail -3 "$OUT/tests.log"
fi
timeout 150 python3 bench/bench_int4.py --out "$OUT/kernels" 2>&1 | quiet || status=1
timeout 100 python3 bench/bench_layer.py --ranks 16 --tokens 8192 --arms frozen sits:cublas sits:int4 sits:nf4 sits:nf4:bitsandbytes peft:nf4 \
    --out "$OUT/layer" 2>&1 | quiet || status=1
if [ "${PROFILE:-1}" = 1 ]; then
    timeout 60 python3 bench/profile_layer.py --d-in 2048 --d-out 8192 --arms sits:cublas sits:int4 \
        > "$OUT/profile_layer.txt" 2>&1 || status=1
fi
grep -E "^== " "$OUT/profile_layer.txt" 2>/dev/null
timeout "${FULL_TIMEOUT:-300}" python3 bench/regress.py --out "$OUT/regress_8b_full" --no-graph-breaks --shapes 8b-full \
    --arm-timeout 150 --arms ${FULL_ARMS:-sits+liger peft+nf4 sits+nf4+liger sits+nf4+bnbdq+liger sits+int4+liger} 2>&1 | quiet
exit "$status"
