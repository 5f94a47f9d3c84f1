# Every device call of the session runs this: the first starts driver.sh in its own process session; each waits
# until the driver is done or its time is nearly up, then copies what has finished to $OUT.
S=.gpu_state/s40
if [ ! -f $S/started ]; then
    mkdir -p $S && touch $S/started
    setsid bash bench/results/2026-12-07-session40/driver.sh > $S/driver.out 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT:-114}); do grep -q ' done$' $S/driver.log 2>/dev/null && break; sleep 5; done
cp -r $S/. $OUT/ 2>/dev/null; rm -f $OUT/started
find $OUT -name '*.png' -size +2M -delete
cat $S/driver.log; tail -3 $S/*.log | tail -40
