# session 37 call 3: the test that failed in the shuffled suite, alone (new tree twice, session-start tree once);
# where the 1B default step's GPU time goes, per kernel, before / after
set -o pipefail
. bench/gpu_env.sh
mkdir -p $OUT/c3
trap 'tar -czf $OUT/c3.tgz -C $OUT c3' EXIT
git status --short > $OUT/c3/rev.txt
git worktree add -q /tmp/base HEAD 2>&1 | tail -1
T="tests/training/test_guardrails_gpu.py::test_skip_on_device_equals_run_without_those_updates"
for tree in new base new; do
  dir=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  (cd $dir && PYTHONPATH=$dir/src:/tmp/site timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEX "$T" 2>&1 | grep -E "^E  |passed|failed" | head -4 | sed "s/^/$tree: /")
done 2>&1 | tee $OUT/c3/skip_test.log
for tree in base new; do
  dir=$([ $tree = base ] && echo /tmp/base || echo $PWD)
  (cd $dir && PYTHONPATH=$dir/src:/tmp/site timeout 100 python3 bench/bench_model.py --model 1b --steps 6 --warmup 3 \
     --arms sits+default --kernels $OUT/c3/kernels_$tree --out $OUT/c3/b1_$tree 2>&1 | grep "^\[" | sed "s/^/$tree: /")
done 2>&1 | tee $OUT/c3/kernels.log
ls -R $OUT/c3 | head -20
