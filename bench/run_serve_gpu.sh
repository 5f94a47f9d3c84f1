#!/usr/bin/env bash
# One GPU call for serving: its GPU tests (mixed batches, the pool, recorded decoding, the small-call path), then
# bench/serve.py.
#
#     bash bench/run_serve_gpu.sh OUT [serve.py arguments ...]
#
# OUT gets tests.log, serve.log and serve/ (JSON, CSV, PNG); PACK=1 ends with everything in one OUT.tgz.
#   TESTS_TIMEOUT=S   stop the tests after S seconds (default 180)
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
    > "$OUT/tests.log" 2>&1
grep -E "FAILED|[0-9]+ passed|[0-9]+ failed|^E " "$OUT/tests.log" | tail -n 30
python3 bench/serve.py --out "$OUT/serve" "$@" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn" \
    | tee "$OUT/serve.log"
exit "${PIPESTATUS[0]}"
