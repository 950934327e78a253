#!/usr/bin/env bash
# The measurements behind docs/scaling.md's out-of-sample check and bucket timelines: start.sh's
# network benchmark (test hosts of tools/hosts.sh over links shaped with tc, as root) five times.
#
#   sudo bash results/scaling-checks.sh     # -> results/scaling/{fit,test1,test2,test3,timeline}
#
# 1. fit: 64 px at 300 Mbit/s, 2 and 4 hosts: the profile, the link across 2 to 4 hosts and the
#    one-host step, from which the model takes its compute's scale factor and its link
# 2. test1..3: 192 px at 2 Gbit/s, 2 and 4 hosts, three times, each report's predictions fitted on
#    1 alone (NET_FIT), beside the no-overlap baseline, with their errors and the bar
# 3. timeline: 224 px at 300 Mbit/s and 1 Gbit/s (two points: one to fit a term on, one to check
#    it), the DDP row and its one-bucket twin, each plain and timed (tools/scaling_model.py
#    timeline), the ranks' summaries gathered in timelines.md
# Each report records its own command, wall time and load. 20 minutes on this project's 2-core
# machine (measured: 19 min 59 s for the committed results/scaling/).
# STEPS, TEST_SIZE, TIMELINE_SIZE and start.sh's ARCH, IMAGE_SIZE make a shorter run of it.
set -euo pipefail
shopt -s nullglob  # a timeline that did not run: no file to gather
cd "$(dirname "$0")/.."
OUT=results/scaling
STEPS=${STEPS:-8}
TEST=distributed+${TEST_SIZE:-192}px
TIMED=distributed+${TIMELINE_SIZE:-224}px
FAILED=0
start() { bash start.sh --hosts 2 --steps "$STEPS" "$@" || FAILED=1; }  # a failed row: go on

start --link 300mbit --rows distributed,distributed+4hosts -o "$OUT/fit"
for i in 1 2 3; do
    NET_FIT=$OUT/fit start --link 2gbit --rows "$TEST,$TEST+4hosts" -o "$OUT/test$i"
done
start --link 300mbit,1gbit -o "$OUT/timeline" \
    --rows "$TIMED,$TIMED+onebucket,$TIMED+timeline,$TIMED+timeline+onebucket"
for run in "$OUT"/timeline/runs-network/*bit/"$TIMED"+timeline*/; do
    printf '## %s\n\n' "${run#"$OUT"/timeline/runs-network/}"
    for f in "$run"timeline-rank*.md; do cat "$f"; echo; done
done >"$OUT/timeline/timelines.md"
echo "results/scaling-checks.sh: wrote $OUT/*/benchmark-network.md and $OUT/timeline/timelines.md"
exit "$FAILED"
