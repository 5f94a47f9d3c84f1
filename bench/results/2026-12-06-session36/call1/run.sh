# session 36 call 1: the whole GPU suite in one process, in file order, each test's end time-stamped
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c1
trap 'tar -czf $OUT/c1.tgz -C $OUT c1' EXIT
git log -1 --format=%H > $OUT/c1/rev.txt; git status --short >> $OUT/c1/rev.txt
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" | tee $OUT/c1/versions.txt
start=$(date +%s)
timeout 560 python3 -m pytest -v -p no:cacheprovider -m gpu -rfEX --durations=40 tests 2>&1 \
  | while IFS= read -r line; do echo "$(( $(date +%s) - start )) $line"; done | tee $OUT/c1/gpu_suite.log | grep -E "FAILED|ERROR|passed|failed" | tail -30
find ~/.triton/cache -name "*.json" 2>/dev/null | wc -l > $OUT/c1/triton_cache_entries.txt
