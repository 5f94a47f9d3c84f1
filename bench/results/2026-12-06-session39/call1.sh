# call 1: the factored x pass tuned; then the whole GPU suite, shuffled,
# in one process started in the background (its own process session) and collected by call 2
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
mkdir -p .gpu_state && export SITS_LORA_TUNING_CACHE=$PWD/.gpu_state/kernel_configs.json
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $OUT/gpu.txt 2>&1
git log --oneline -1 >> $OUT/gpu.txt 2>&1; nproc >> $OUT/gpu.txt
timeout 200 python3 bench/results/2026-12-06-session39/xpass_tune.py $OUT/xpass_tune.json > $OUT/xpass_tune.log 2>&1
cp .gpu_state/kernel_configs.json $OUT/ 2>/dev/null
unset SITS_LORA_TUNING_CACHE
rm -f .gpu_state/suite.log .gpu_state/suite.rc
setsid bash -c 'python3 -m pytest -v -p no:cacheprovider -p random_order --random-order-bucket=global --random-order-seed=3939 -m gpu -rfEX tests > .gpu_state/suite.log 2>&1; echo $? > .gpu_state/suite.rc' > /dev/null 2>&1 < /dev/null &
sleep 5; tail -3 .gpu_state/suite.log
