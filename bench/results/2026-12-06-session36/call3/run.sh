# session 36 call 3: the tests call 1 did not reach, the recorded plan test's numbers, then the gate after the fix
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c3
trap 'tar -czf $OUT/c3.tgz -C $OUT c3' EXIT
git log -1 --format=%H > $OUT/c3/rev.txt; git status --short >> $OUT/c3/rev.txt
timeout 100 python3 -m pytest -v -p no:cacheprovider -m gpu -rfEX "tests/tuner/test_compile_gpu.py::test_dynamic_rank_compiles_without_breaks" tests/utils/test_timing.py 2>&1 | tee $OUT/c3/rest.log | tail -12
timeout 60 python3 -m pytest -q -s -p no:cacheprovider -m gpu --runxfail -rfEX "tests/training/test_guardrails_gpu.py::test_plan_within_15_percent_of_cuda_peak[recorded]" 2>&1 | tee $OUT/c3/recorded_plan.log | tail -40
timeout 420 python3 bench/regress.py --out $OUT/c3/gate --shapes 0.5b 1b 8b --repeats 3 --no-graph-breaks --arms frozen+liger sits+default 2>&1 | tee $OUT/c3/gate.log | tail -45
