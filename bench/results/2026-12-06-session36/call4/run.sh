# session 36 call 4: the layer step's host time before (session start, 11678c1) and after; eager 1B arms before/after;
# the GPU tests of the changed paths; the recorded plan's step peaks
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c4
trap 'tar -czf $OUT/c4.tgz -C $OUT c4' EXIT
git log -1 --format=%H > $OUT/c4/rev.txt; git status --short >> $OUT/c4/rev.txt
git worktree add -q /tmp/base HEAD 2>&1 | tail -1; (cd /tmp/base && git log -1 --format="base %H" >> $OUT/c4/rev.txt)
NEW=$PWD
for round in 1 2; do
  for tree in base new; do
    dir=$([ $tree = base ] && echo /tmp/base || echo $NEW)
    (cd $dir && PYTHONPATH=$dir/src:/tmp/site timeout 60 python3 bench/profile_host.py --out $OUT/c4/host_${tree}_$round \
       --arms frozen sits:cublas --steps 200 > $OUT/c4/host_${tree}_$round.log 2>&1)
    python3 -c "import json,sys; d=json.load(open('$OUT/c4/host_${tree}_$round/host.json')); print('$tree $round', {k: round(v,1) for k,v in d['layer_step_host_us'].items()})"
  done
done
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX tests/ops tests/fp8 tests/int4 tests/dynamic_rank \
  tests/training tests/activations tests/serving "tests/tuner/test_compile_gpu.py::test_dynamic_rank_compiles_without_breaks" \
  tests/utils/test_timing.py "tests/cli/test_cli.py::test_gpu_bench_measures_every_part" 2>&1 | tee $OUT/c4/gpu_tests.log | tail -8
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu --runxfail "tests/training/test_guardrails_gpu.py::test_plan_within_15_percent_of_cuda_peak[recorded]" 2>&1 | tee $OUT/c4/recorded_peaks.log | grep -E "^E  " | head -12
for round in 1; do
  for tree in base new; do
    dir=$([ $tree = base ] && echo /tmp/base || echo $NEW)
    (cd $dir && PYTHONPATH=$dir/src:/tmp/site timeout 75 python3 bench/bench_model.py --model 1b --steps 6 --warmup 3 \
       --arms sits+liger --out $OUT/c4/b1_${tree}_$round 2>&1 | grep "^\[" | sed "s/^/$tree: /")
  done
  timeout 60 python3 bench/bench_model.py --model 1b --steps 6 --warmup 3 --arms frozen+liger --out $OUT/c4/b1_floor_$round 2>&1 | grep "^\["
done
