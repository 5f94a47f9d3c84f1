# call 1: the whole GPU suite, shuffled, in one process started in its own process session (it outlives the call
# when it needs longer; call 2 collects it)
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $OUT/gpu.txt 2>&1
nproc >> $OUT/gpu.txt
mkdir -p .gpu_state && rm -f .gpu_state/suite.log .gpu_state/suite.rc
setsid bash -c 'python3 -m pytest -v -p no:cacheprovider -p random_order --random-order-bucket=global --random-order-seed=3939 -m gpu -rfEX tests 2>&1 | while IFS= read -r line; do printf "%s %s\n" "$SECONDS" "$line"; done > .gpu_state/suite.log; echo ${PIPESTATUS[0]} > .gpu_state/suite.rc' > /dev/null 2>&1 < /dev/null &
for i in $(seq 1 113); do [ -f .gpu_state/suite.rc ] && break; sleep 5; done
cp .gpu_state/suite.log $OUT/gpu_suite_shuffled_part1.log; cat .gpu_state/suite.rc 2>/dev/null
tail -5 .gpu_state/suite.log
