# call 2: wait for call 1's suite (the same process) and collect its log; then the gate at 1B, one run per arm
. bench/gpu_env.sh > $OUT/gpu.txt 2>&1
for i in $(seq 1 60); do [ -f .gpu_state/suite.rc ] && break; sleep 5; done
cp .gpu_state/suite.log $OUT/gpu_suite_shuffled.log; cat .gpu_state/suite.rc > $OUT/suite.rc 2>/dev/null
tail -20 .gpu_state/suite.log
[ -f .gpu_state/suite.rc ] || exit 3
timeout 280 python3 -m bench run gate $OUT gate -- --shapes 1b --repeats 1 --no-graph-breaks --arms frozen+liger sits+default
tail -30 $OUT/gate.log
