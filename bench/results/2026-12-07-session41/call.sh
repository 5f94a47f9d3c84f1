# Every device call of the session runs this: the first starts driver.sh in its own process session; each waits
# until the driver is done or its time is nearly up, then copies what has finished to $OUT.
S=.gpu_state/s41
# a part of the SmolLM2 GGUF carried by this call (split_gguf.sh) stays on the machine for the driver's quality runs
mkdir -p .gpu_state/gguf_s41; for d in .gg1 .gg2 .gg3; do [ -f $d/part ] && cp $d/* .gpu_state/gguf_s41/ && mv .gpu_state/gguf_s41/part .gpu_state/gguf_s41/$d.part; done
if [ ! -f $S/started ]; then
    mkdir -p $S && touch $S/started
    GATE_REPEATS=${GATE_REPEATS:-3} SUITE_FIRST=${SUITE_FIRST:-0} setsid bash bench/results/2026-12-07-session41/driver.sh > $S/driver.out 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT:-114}); do grep -q ' done$' $S/driver.log 2>/dev/null && break; sleep 5; done
# one archive: a call brings back at most 8 files (the device README), so a folder copied file by file loses most
tar czf $OUT/state.tgz --exclude='*.png' --exclude=started -C $S . ; cp $S/driver.log $OUT/ 2>/dev/null
cat $S/driver.log; tail -n 3 $S/*.log | tail -n 40
