# One device call: the gate's default step at HEAD and at the tree before the package was regrouped (BASE, default
# b6158e3: every step-time change of issues 48 and 49 in, none of the GPU-path moves of issue 50: private
# attributes, fp8.py split, config/ and layers/ folders, the forward plan), interleaved on one machine: at 1B three
# times, at 0.5B and 8B twice. The floor (frozen + Liger) runs from HEAD beside each pair. Results in one archive
# (a call brings back at most 8 files). The base tree travels as .base/ (src and bench of BASE, made here with
#   mkdir .base && git archive b6158e3 src bench ':!bench/results' | tar -x -C .base && git rev-parse b6158e3 > .base/REV
# since the device's copy need not hold .git). Carry [".whl", ".base"].
set -o pipefail
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
R=$OUT/ab; mkdir -p $R; trap 'tar -czf $OUT/ab.tgz -C $OUT ab' EXIT
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $OUT/gpu.txt
(git log -1 --format="head %H" || echo "head: no .git on the device") > $R/rev.txt 2>&1; git status --short >> $R/rev.txt 2>&1
rm -rf /tmp/base; cp -r .base /tmp/base; echo "base $(cat /tmp/base/REV)" >> $R/rev.txt
STD=$PYTHONPATH; SITE=$(echo $STD | tr ':' '\n' | grep /tmp/site | head -1)
pair() {  # shape repeat
  timeout 90 python3 bench/regress.py --out $R/head_$1_$2 --shapes $1 --repeats 1 --no-graph-breaks \
      --arms frozen+liger sits+default 2>&1 | grep "^\[$1" | sed "s/^/head $2 /"
  (cd /tmp/base && PYTHONPATH=/tmp/base/src:$SITE timeout 60 python3 bench/regress.py --out $R/base_$1_$2 --shapes $1 \
      --repeats 1 --no-graph-breaks --arms sits+default 2>&1 | grep "^\[$1" | sed "s/^/base $2 /")
}
for r in 1 2 3; do pair 1b $r; done 2>&1 | tee $R/gate_1b.log
for s in 0.5b 8b; do for r in 1 2; do pair $s $r; done; done 2>&1 | tee $R/gate_05b_8b.log
cat $OUT/gpu.txt
