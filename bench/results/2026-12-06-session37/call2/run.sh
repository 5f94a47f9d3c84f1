# session 37 call 2: wait for the shuffled GPU suite that call 1 started, then collect its log
mkdir -p $OUT/c2
while [ ! -f /tmp/suite/done ] && [ $SECONDS -lt 575 ]; do sleep 5; done
cp /tmp/suite/log $OUT/c2/gpu_suite_shuffled.log 2>/dev/null
ls /tmp/suite/done 2>/dev/null && echo DONE || echo "still running at ${SECONDS}s"
grep -E "FAILED|ERROR|passed|failed" $OUT/c2/gpu_suite_shuffled.log | tail -25
