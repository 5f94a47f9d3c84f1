# session 38 call 3: the skip test with its bounds on the fraction of values off by lr/2; the gate at 0.5B and 8B
set -o pipefail
. bench/gpu_env.sh
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX tests/training/test_guardrails_gpu.py::test_skip_on_device_equals_run_without_those_updates 2>&1 | tail -3
timeout 250 python3 -m bench run gate $OUT/g gate -- --shapes 0.5b 8b --repeats 2 --no-graph-breaks --arms frozen+liger sits+default 2>&1 | grep -E "ok|FAIL|failed|ms" | tail -14
