#!/usr/bin/env bash
# One GPU call for several processes: the recipe under accelerate's configs (tests/recipe/test_recipe_accelerate_gpu.py),
# then bench/multi_gpu.py on the GPUs the machine has: on one GPU each wrapper (DDP, FSDP2) over a one-rank process
# group (--world 1: the code path and the wrapper's cost); on two or more the scaling runs and the loss curves.
#
#     bash bench/run_multi_gpu.sh OUT [multi_gpu.py arguments ...]
#
# The recipe needs datasets, dill and multiprocess, which the GPU image lacks: carry their wheels in .whl/.
# OUT gets tests.log, multi/ (multi_gpu.json / .csv / .png) + multi.log and, on 2+ GPUs, curve/ + curve.log.
#   TESTS_TIMEOUT=S   stop the tests after S seconds (default 240)
#   PACK=1            end with everything in one OUT.tgz (the device tool returns at most 8 files)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash bench/run_multi_gpu.sh OUT [multi_gpu.py arguments ...]" >&2
    exit 2
fi
OUT="$1"; shift
mkdir -p "$OUT"
. bench/gpu_env.sh
trap pack EXIT
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -v -rfEs --tb=short -m gpu tests/recipe/test_recipe_accelerate_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "PASSED|FAILED|SKIPPED|[0-9]+ passed|[0-9]+ failed|^E " "$OUT/tests.log" | tail -n 30
if [ "$GPUS" -ge 2 ]; then
    python3 bench/multi_gpu.py --out "$OUT/multi" "$@" 2>&1 | tee "$OUT/multi.log"
    status=${PIPESTATUS[0]}
    python3 bench/multi_gpu.py --out "$OUT/curve" --loss-curve 2>&1 | tee "$OUT/curve.log"
else
    python3 bench/multi_gpu.py --out "$OUT/multi" --world 1 "$@" 2>&1 | tee "$OUT/multi.log"
    status=${PIPESTATUS[0]}
fi
exit "$status"
