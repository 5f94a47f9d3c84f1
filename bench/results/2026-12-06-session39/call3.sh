# call 3: the gate at this tree, with the factored x pass tuned in call 1 (its cache), one run per arm and shape (device time)
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
export SITS_LORA_TUNING_CACHE=$PWD/.gpu_state/kernel_configs.json
timeout 580 python3 -m bench run gate $OUT gate -- --shapes 1b 0.5b 8b --repeats 1 --no-graph-breaks --arms frozen+liger sits+default
tail -40 $OUT/gate.log
