#!/usr/bin/env bash
# The INT4 base's GPU checks in one device call (~3 min): its GPU tests, its kernels alone (bench_int4.py), and
# one layer against the bf16 path and PEFT's QLoRA layer (bench_layer.py). Wheels the GPU image lacks
# (liger-kernel, gguf, bitsandbytes) travel in .whl/ (bench/gpu_env.sh installs them).
#
#     bash bench/run_int4_gpu.sh OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash bench/run_int4_gpu.sh OUT}"
mkdir -p "$OUT"
. bench/gpu_env.sh
status=0
timeout 60 python3 -m pytest -q -p no:logging -rfE --tb=short -m gpu tests/int4 > "$OUT/tests.log" 2>&1 || status=1
grep -E "passed|failed|^E " "$OUT/tests.log" | tail -n 12
timeout 40 python3 bench/bench_int4.py --out "$OUT/kernels" 2>&1 | grep -v -E "Warning|warn" || status=1
timeout 70 python3 bench/bench_layer.py --ranks 16 --tokens 8192 --arms frozen sits:cublas sits:int4 peft:nf4 \
    --out "$OUT/layer" 2>&1 | grep -v -E "Warning|warn" || status=1
exit "$status"
