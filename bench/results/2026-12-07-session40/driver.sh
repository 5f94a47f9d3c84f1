# The session's device work as one background job (started by call.sh in its own process session, so it outlives a
# call; each call collects what has finished). Parts in order of importance; each writes under .gpu_state/s40/.
S=.gpu_state/s40
stamp() { printf '%s %s\n' "$SECONDS" "$*" >> $S/driver.log; }
. bench/gpu_env.sh > $S/gpu.txt 2>&1
python3 -c "import torch, triton, transformers, peft, liger_kernel; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" >> $S/gpu.txt 2>&1
nproc >> $S/gpu.txt; git log -1 --format=%H >> $S/gpu.txt 2>/dev/null
STD=$PYTHONPATH
stamp start gate
# 1. the gate at HEAD (issue 48; issue 50's "gate within 3 %")
python3 bench/regress.py --out $S/gate --shapes 1b 0.5b 8b --repeats 1 --no-graph-breaks \
    --arms frozen+liger sits+default > $S/gate.log 2>&1; stamp gate rc $?
# 2. the Trainer's step with batches copied blocking or not (issue 48's host wait; the trainer change that turns the
# non-blocking copy on is on branch trainer-nonblocking until its GPU suite runs)
python3 bench/trainer_step.py --out $S/trainer_step --repeats 1 --steps 20 > $S/trainer_step.log 2>&1; stamp trainer_step rc $?
# 2b. the 1B gate again: a second run of its two arms (device time lost to failed starts left one repeat above)
python3 bench/regress.py --out $S/gate_1b_again --shapes 1b --repeats 1 --no-graph-breaks \
    --arms frozen+liger sits+default > $S/gate_1b_again.log 2>&1; stamp gate_1b_again rc $?
# 3. Unsloth beside us, bf16 at 1B and 8B (4 layers) (issue 49)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_u .whl_unsloth/*.whl > $S/pip_unsloth.txt 2>&1
export PYTHONPATH=/tmp/site_u:$STD HF_HUB_OFFLINE=1
python3 bench/regress.py --out $S/unsloth --shapes 1b 8b --repeats 1 --no-graph-breaks --arm-timeout 400 \
    --arms frozen+liger sits+default unsloth > $S/unsloth.log 2>&1; stamp unsloth rc $?
# 4. QLoRA on the whole 8B shape: ours against Unsloth's, peak memory beside
python3 bench/regress.py --out $S/qlora --shapes 8b-full --repeats 1 --no-graph-breaks --arm-timeout 500 \
    --arms sits+nf4+liger unsloth+nf4 > $S/qlora.log 2>&1; stamp qlora rc $?
export PYTHONPATH=$STD; unset HF_HUB_OFFLINE
# 5. the skip test alone, three processes (it failed in 2 of 6 before its eager-attention fix)
for i in 1 2 3; do
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_guardrails_gpu.py -k skip >> $S/skip.log 2>&1
    stamp skip $i rc $?
done
stamp done
