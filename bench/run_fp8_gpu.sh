#!/usr/bin/env bash
# Issue 6 (fp8 frozen base) on one H200, about 5 minutes: GPU tests, the per-layer and the 8B-model arms,
# then a summary against the issue's targets.
#
#     bash bench/run_fp8_gpu.sh [OUT [ARM...]]   # OUT defaults to bench/results/fp8
#
# ARMs: the 8B arms of step 3 (default: frozen frozen+compile sits+fp8 sits+fp8+compile, about 4 minutes;
# each compiled arm compiles for 70-90 s). With CUDA graphs, e.g.
#     bash bench/run_fp8_gpu.sh OUT frozen frozen+compile frozen+compile+cg sits+fp8 sits+fp8+compile+cg
#
# Writes OUT/gpu_tests.log, OUT/layer.{json,csv}, OUT/model_8b.{json,csv,png}, OUT/fp8_summary.json.
# Each step runs even when an earlier one failed; the exit status is the worst of them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/fp8}"
shift $(( $# > 0 ? 1 : 0 ))
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(frozen frozen+compile sits+fp8 sits+fp8+compile)
mkdir -p "$OUT"
status=0

echo "== 1/4 GPU tests (tests/fp8/test_fp8_gpu.py) =="
python -m pytest -q -m gpu tests/fp8/test_fp8_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1

echo "== 2/4 one layer, T = 8192, r = 16: frozen bf16 floor, sits bf16, sits fp8 =="
python bench/bench_layer.py --arms frozen sits:cublas sits:fp8 --ranks 16 --out "$OUT" || status=1

echo "== 3/4 Llama-3-8B shape, bs 4 x 2048: ${ARMS[*]} =="
python bench/bench_model.py --model 8b --warmup 2 --steps 5 --arms "${ARMS[@]}" --out "$OUT" || status=1

echo "== 4/4 summary =="
python bench/fp8_summary.py "$OUT" || status=1
exit $status
