# session 38 call 1: what differs in the skip test, then the whole shuffled `pytest -m gpu` in one process
set -o pipefail
. bench/gpu_env.sh
git log --oneline -1 > $OUT/rev.txt 2>/dev/null; git status --short >> $OUT/rev.txt 2>/dev/null
timeout 100 python3 bench/results/2026-12-06-session37/not-run/skip_debug.py 2>&1 | grep -v Warning | tail -20 | tee $OUT/skip_debug.log
timeout 470 python3 -m pytest -v -p no:cacheprovider -p random_order --random-order-bucket=global --random-order-seed=3808 \
  -m gpu -rfEX --durations=15 tests > $OUT/gpu_tests.log 2>&1
echo "pytest rc $?"
grep -E "FAILED|ERROR|XPASS|[0-9]+ passed|[0-9]+ failed" $OUT/gpu_tests.log | tail -25
