# session 36 call 2: the two failures of call 1, with their tracebacks
. bench/gpu_env.sh
mkdir -p $OUT/c2
python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX "tests/cli/test_cli.py::test_gpu_bench_measures_every_part" "tests/training/test_guardrails_gpu.py::test_plan_within_15_percent_of_cuda_peak" 2>&1 | tee $OUT/c2/two.log | tail -60
