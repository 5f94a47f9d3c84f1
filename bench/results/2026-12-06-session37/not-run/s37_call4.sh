# session 37 call 4: what differs in the skip test (both trees fail it alike); the GPU tests of the final tree's
# changed parts
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c4
git status --short > $OUT/c4/rev.txt
timeout 120 python3 .scratch/skip_debug.py 2>&1 | grep -v Warning | tail -20 | tee $OUT/c4/skip_debug.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX tests/activations/test_recompute_gpu.py \
  "tests/ops/test_kernels_gpu.py::test_x_pass_on_liger_swiglu_factors_is_bit_identical_to_its_output" \
  "tests/training/test_guardrails_gpu.py::test_plan_within_15_percent_of_cuda_peak" tests/ops/test_launch_gpu.py 2>&1 | tee $OUT/c4/gpu_tests.log | tail -5
timeout 150 python3 .scratch/xpass_sweep.py $OUT/c4/xpass_sweep.json 2>&1 | tail -6 | tee $OUT/c4/xpass_sweep.log
