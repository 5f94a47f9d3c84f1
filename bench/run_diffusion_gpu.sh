#!/usr/bin/env bash
# One GPU call for the diffusion work: its GPU tests (and the recorded training step's), then bench/diffusion.py.
#
#     bash bench/run_diffusion_gpu.sh OUT [diffusion.py arguments ...]
#
# Wheels the GPU image lacks (diffusers and what it imports: pillow, importlib_metadata, zipp) travel in .whl/;
# bench/gpu_env.sh installs them into /tmp/site. OUT gets tests.log, diffusion.log and diffusion/ (JSON, CSV, PNG);
# PACK=1 ends with everything in one OUT.tgz (the device tool returns at most 8 files).
#   TESTS_TIMEOUT=S   stop the tests after S seconds (default 180)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash bench/run_diffusion_gpu.sh OUT [diffusion.py arguments ...]" >&2
    exit 2
fi
OUT="$1"; shift
mkdir -p "$OUT"
. bench/gpu_env.sh
trap pack EXIT
timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -v -rfE --tb=short -m gpu tests/diffusion \
    tests/ops/test_aten_path.py tests/training/test_graph_train_step.py tests/recipe/test_train_diffusion.py \
    > "$OUT/tests.log" 2>&1
grep -E "FAILED|[0-9]+ passed|[0-9]+ failed|^E " "$OUT/tests.log" | tail -n 30
python3 bench/diffusion.py --out "$OUT/diffusion" "$@" 2>&1 | grep --line-buffered -v -E "Warning|warnings.warn" \
    | tee "$OUT/diffusion.log"
exit "${PIPESTATUS[0]}"
