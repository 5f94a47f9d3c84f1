# One device call: Unsloth's bf16 LoRA beside ours at 1B and 8B (4 of 32 layers), the floor beside it, one run per
# arm (session41's run of this was lost: a call returns at most 8 files). Carry [".whl", ".whl_unsloth"]. Results in
# one archive.
set -o pipefail
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
R=$OUT/unsloth; mkdir -p $R; trap 'tar -czf $OUT/unsloth.tgz --exclude="*.png" -C $OUT unsloth' EXIT
git log -1 --format="head %H" > $R/rev.txt; git status --short >> $R/rev.txt
nproc >> $OUT/gpu.txt; lscpu | grep -E "Model name" >> $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_u .whl_unsloth/*.whl > $R/pip.txt 2>&1
export PYTHONPATH=/tmp/site_u:$PYTHONPATH HF_HUB_OFFLINE=1
timeout 520 python3 bench/regress.py --out $R/run --shapes 1b 8b --repeats 1 --no-graph-breaks --arm-timeout 200 \
    --arms frozen+liger sits+default unsloth unsloth+gc > $R/unsloth.log 2>&1; echo "unsloth rc $?"
grep -E "^\[|^1b|^8b|FAIL|ok " $R/unsloth.log; cat $OUT/gpu.txt
