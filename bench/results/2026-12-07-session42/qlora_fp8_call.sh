# One device call: QLoRA on the whole 8B shape with fp8 compute over the NF4 storage (sits+nf4+fp8+liger: each
# layer's W formed in e4m3 per GEMM; quality in docs/quantization.md) beside Unsloth's QLoRA. Carry
# [".whl", ".whl_unsloth"]. Results in one archive (qlora_fp8.tgz).
set -o pipefail
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
R=$OUT/qlora_fp8; mkdir -p $R; trap 'tar -czf $OUT/qlora_fp8.tgz --exclude="*.png" -C $OUT qlora_fp8' EXIT
git log -1 --format="head %H" > $R/rev.txt; git status --short >> $R/rev.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_u .whl_unsloth/*.whl > $R/pip.txt 2>&1
export PYTHONPATH=/tmp/site_u:$PYTHONPATH HF_HUB_OFFLINE=1
timeout 330 python3 bench/regress.py --out $R/run --shapes 8b-full --repeats 1 --no-graph-breaks --arm-timeout 200 \
    --arms sits+nf4+fp8+liger unsloth+nf4 > $R/qlora.log 2>&1; echo "qlora rc $?"
grep -E "^\[8b|^8b-full|FAIL|ok " $R/qlora.log; cat $OUT/gpu.txt
