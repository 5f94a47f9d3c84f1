# call 2: wait for call 1's suite (one process), then collect its log
for i in $(seq 1 115); do [ -f .gpu_state/suite.rc ] && break; sleep 5; done
cp .gpu_state/suite.log $OUT/gpu_suite_shuffled.log; cat .gpu_state/suite.rc 2>/dev/null > $OUT/suite.rc
tail -25 .gpu_state/suite.log
