# One device call: QLoRA on the whole 8B shape with the recorded default step over the NF4 base (sits+nf4+default,
# never run on a GPU yet) beside our eager NF4 step and Unsloth's QLoRA. bitsandbytes and Unsloth come from the
# carried Unsloth wheel set. Carry [".whl", ".whl_unsloth"]. Results in one archive (a call brings back at most 8 files).
set -o pipefail
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
R=$OUT/qlora; mkdir -p $R; trap 'tar -czf $OUT/qlora.tgz --exclude="*.png" -C $OUT qlora' EXIT
git log -1 --format="head %H" > $R/rev.txt; git status --short >> $R/rev.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_u .whl_unsloth/*.whl > $R/pip.txt 2>&1
export PYTHONPATH=/tmp/site_u:$PYTHONPATH HF_HUB_OFFLINE=1
timeout 500 python3 bench/regress.py --out $R/run --shapes 8b-full --repeats 1 --no-graph-breaks --arm-timeout 240 \
    --arms sits+nf4+liger sits+nf4+default unsloth+nf4 > $R/qlora.log 2>&1; echo "qlora rc $?"
grep -E "^\[8b|^8b-full|FAIL|ok " $R/qlora.log; cat $OUT/gpu.txt
