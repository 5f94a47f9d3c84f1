#!/usr/bin/env bash
# One GPU call for serving: its GPU tests (mixed batches, the pool, recorded decoding, the decode and small-call
# paths), then bench/decode_kernels.py (with DECODE_KERNELS=1; serve.py then uses the configurations it measured),
# then bench/serve.py.
#
#     bash bench/run_serve_gpu.sh OUT [serve.py arguments ...]
#
# OUT gets tests.log, decode/ + decode.log, serve.log and serve/ (JSON, CSV, PNG); PACK=1 ends with everything in
# one OUT.tgz.
#   TESTS_TIMEOUT=S   stop the tests after S seconds (default 180)
#   DECODE_KERNELS=1  time the decode kernel against the merged GEMM and tune it first
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash bench/run_serve_gpu.sh OUT [serve.py arguments ...]" >&2
    exit 2
fi
OUT="$1"; shift
mkdir -p "$OUT"
. bench/gpu_env.sh
trap pack EXIT
timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -v -rfE --tb=short -m gpu tests/serving tests/ops/test_aten_path.py \
    tests/ops/test_decode.py > "$OUT/tests.log" 2>&1
grep -E "FAILED|[0-9]+ passed|[0-9]+ failed|^E " "$OUT/tests.log" | tail -n 30
if [ "${DECODE_KERNELS:-0}" = 1 ]; then
    python3 bench/decode_kernels.py --out "$OUT/decode" 2>&1 | grep --line-buffered -v "Warning" | tee "$OUT/decode.log" \
        | grep -v "^  skipped"
    export SITS_LORA_TUNING_CACHE="$OUT/decode/decode_configs.json"
fi
python3 bench/serve.py --out "$OUT/serve" "$@" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn" \
    | tee "$OUT/serve.log"
exit "${PIPESTATUS[0]}"
