# session 37 call 1: GPU tests of the change; the gate before (session start d190520, worktree) / after at 1B, after at
# 0.5B and 8B; the recorded plan case alone; then the whole GPU suite, shuffled, started in its own process session
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c1
trap 'tar -czf $OUT/c1.tgz -C $OUT c1' EXIT
git log -1 --format=%H > $OUT/c1/rev.txt; git status --short >> $OUT/c1/rev.txt
git worktree add -q /tmp/base HEAD 2>&1 | tail -1; (cd /tmp/base && git log -1 --format="base %H" >> $OUT/c1/rev.txt)
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" | tee $OUT/c1/versions.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX \
  "tests/ops/test_kernels_gpu.py::test_x_pass_on_liger_swiglu_factors_is_bit_identical_to_its_output" \
  tests/activations/test_recompute_gpu.py tests/ops/test_launch_gpu.py 2>&1 | tee $OUT/c1/gpu_tests.log | tail -6
timeout 60 python3 -m pytest -q -s -p no:cacheprovider -m gpu -rfEX \
  "tests/training/test_guardrails_gpu.py::test_plan_within_15_percent_of_cuda_peak[recorded]" 2>&1 | tee $OUT/c1/recorded_plan.log | tail -4
NEW=$PWD
for r in 1 2 3; do
  timeout 60 python3 bench/regress.py --out $OUT/c1/gate1b_new_$r --shapes 1b --repeats 1 --no-graph-breaks --arms frozen+liger sits+default 2>&1 | grep "^\[1b" | sed "s/^/new $r /"
  (cd /tmp/base && PYTHONPATH=/tmp/base/src:/tmp/site timeout 40 python3 bench/regress.py --out $OUT/c1/gate1b_base_$r --shapes 1b --repeats 1 --no-graph-breaks --arms sits+default 2>&1 | grep "^\[1b" | sed "s/^/base $r /")
done 2>&1 | tee $OUT/c1/gate1b.log
timeout 230 python3 bench/regress.py --out $OUT/c1/gate --shapes 0.5b 8b --repeats 3 --no-graph-breaks --arms frozen+liger sits+default 2>&1 | tee $OUT/c1/gate.log | tail -8
# the whole GPU suite, one process, shuffled (pytest-random-order from .whl), from a copy of the tree; it outlives this
# call (its own process session) and the next call collects it
rm -rf /tmp/suite && mkdir -p /tmp/suite && cp -a $NEW /tmp/suite/tree && rm -rf /tmp/suite/tree/.whl
cd /tmp/suite/tree && PYTHONPATH=/tmp/suite/tree/src:/tmp/site setsid nohup bash -c 'start=$(date +%s); timeout 1100 python3 -m pytest -v -p no:cacheprovider \
  -p random_order --random-order-bucket=global --random-order-seed=3707 -m gpu -rfEX tests 2>&1 \
  | while IFS= read -r line; do echo "$(( $(date +%s) - start )) $line"; done > /tmp/suite/log; touch /tmp/suite/done' \
  > /dev/null 2>&1 < /dev/null &
sleep 5; head -5 /tmp/suite/log | tee $OUT/c1/suite_start.log
