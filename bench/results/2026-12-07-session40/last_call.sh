# The session's last device call, when failed machine starts had left about 390 s of device time: the gate alone,
# one run of each arm at each shape, in the foreground.
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__, liger_kernel.__file__)" >> $OUT/gpu.txt 2>&1
nproc >> $OUT/gpu.txt
python3 bench/regress.py --out $OUT/gate --shapes ${SHAPES:-1b 0.5b 8b} --repeats 1 --no-graph-breaks \
    --arms frozen+liger sits+default 2>&1 | tee $OUT/gate.log | grep -v Warning | tail -45
