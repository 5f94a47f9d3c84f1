#!/usr/bin/env bash
# One GPU call for the fast-path work: the compile and kernel GPU tests, the host profile, then the gate.
#
#     bash bench/run_regress_gpu.sh OUT [regress.py arguments ...]
#
# Wheels the GPU image lacks (liger-kernel) travel in .whl/ (see bench/NOTES.md); the call installs them
# into /tmp/site first. Everything lands in OUT: tests.log, host/, graph_breaks/ and regress/ with the
# regress table last in the output. The gate's exit status is this script's.
#   FP8_CROSSOVER=1   first measure where the fp8 base pays per layer shape (bench/tune_kernels.py --fp8)
#                     into OUT/tune/, and run the gate with those measurements (fp8_layers="auto")
#   GPU_TESTS="..."   more test files after tests/tuner/test_compile_gpu.py; GPU_TESTS=all: every test marked gpu
#                     but the docs tests (their notebook runner is not in the GPU image; about 300 s);  HOST_PROFILE=0 skips the host profile
#   PACK=1            end with everything in one OUT.tgz (the device tool returns at most 8 files)
#   TESTS_TIMEOUT=S   stop the tests after S seconds
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash bench/run_regress_gpu.sh OUT [regress.py arguments ...]" >&2
    exit 2
fi
OUT="$1"; shift
mkdir -p "$OUT"
. bench/gpu_env.sh
trap pack EXIT
if [ "${FP8_CROSSOVER:-0}" = 1 ]; then
    python3 bench/tune_kernels.py --fp8 --no-kernels --out "$OUT/tune" 2>&1 | grep --line-buffered -E "^fp8|cache|Error"
    export SITS_LORA_TUNING_CACHE="$OUT/tune/kernel_configs.json"
fi
# TESTS_TIMEOUT=S stops the tests after S seconds (their log names each test as it finishes); 0: no limit
if [ "${GPU_TESTS:-}" = all ]; then
    timeout "${TESTS_TIMEOUT:-0}" python3 -m pytest -v -p no:logging -rfE --tb=short -m gpu --ignore=tests/docs tests \
        > "$OUT/tests.log" 2>&1
else
    timeout "${TESTS_TIMEOUT:-0}" python3 -m pytest -v -p no:logging -rfE --tb=short tests/tuner/test_compile_gpu.py \
        ${GPU_TESTS:-} > "$OUT/tests.log" 2>&1
fi
[ $? = 124 ] && echo "tests stopped after ${TESTS_TIMEOUT} s: $(grep -c PASSED "$OUT/tests.log") passed, $(grep -c FAILED "$OUT/tests.log") failed so far"
grep -E "FAILED|[0-9]+ passed|[0-9]+ failed|^E " "$OUT/tests.log" | tail -n 30
[ "${HOST_PROFILE:-1}" = 1 ] && python3 bench/profile_host.py --out "$OUT/host" 2>&1 | grep -E "host per call|layer step" | head -n 20
python3 bench/regress.py --out "$OUT/regress" "$@" 2>&1 | grep --line-buffered -v -E "^W[0-9]{4}|Warning|warnings.warn" | tee "$OUT/regress.log"
exit "${PIPESTATUS[0]}"
