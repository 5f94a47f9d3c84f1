# session 38 call 2: the gate at 1B (medians of 2), then the GPU tests call 1 did not reach (same seed, the done ones deselected)
set -o pipefail
. bench/gpu_env.sh
timeout 230 python3 -m bench run gate $OUT/g gate -- --shapes 1b --repeats 2 --no-graph-breaks --arms frozen+liger sits+default 2>&1 | tail -12
timeout 330 python3 -m pytest -v -p no:cacheprovider -p random_order --random-order-bucket=global --random-order-seed=3808 \
  -m gpu -rfEX $(sed 's/^/--deselect /' bench/results/2026-12-06-session38/call2/call1_done.txt) tests > $OUT/gpu_tests_rest.log 2>&1
echo "pytest rc $?"
grep -E "FAILED|ERROR|XPASS|[0-9]+ passed|[0-9]+ failed" $OUT/gpu_tests_rest.log | tail -25
