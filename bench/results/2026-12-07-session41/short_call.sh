# One call in the foreground, for when too little device time is left for the GPU suite (about 660 s on a fresh
# machine): the gate at HEAD (1B twice, 0.5B and 8B once) and the Trainer's step with the batch copy blocking or not
# (bench/trainer_step.py sets the copy per arm, so it measures main as it is). Each part under its own time limit.
set -o pipefail
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $OUT/gpu.txt 2>&1
nproc >> $OUT/gpu.txt; lscpu | grep -E "Model name" >> $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 210 python3 bench/regress.py --out $OUT/gate_1b --shapes 1b --repeats 2 --no-graph-breaks \
    --arms frozen+liger sits+default > $OUT/gate_1b.log 2>&1; echo "gate_1b rc $?"
timeout 150 python3 bench/trainer_step.py --out $OUT/trainer_step --repeats 1 --steps 20 > $OUT/trainer_step.log 2>&1
echo "trainer_step rc $?"
timeout 190 python3 bench/regress.py --out $OUT/gate_05b_8b --shapes 0.5b 8b --repeats 1 --no-graph-breaks \
    --arms frozen+liger sits+default > $OUT/gate_05b_8b.log 2>&1; echo "gate_05b_8b rc $?"
find $OUT -name '*.png' -size +2M -delete
grep -hE "ms|x the floor|FAIL|ok " $OUT/gate_1b.log $OUT/gate_05b_8b.log | grep -v Warning | tail -30; tail -12 $OUT/trainer_step.log
