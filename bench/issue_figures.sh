#!/usr/bin/env bash
# Every figure issues 36 and 37 ask a closing note for, in one run, one bench after another (on 2
# cores, two at once would measure each other). Run it on a clean clone, so the venv, the zoo and
# ./dev demo's store are made here:
#
#   git clone -q /path/to/farm /tmp/figures && cd /tmp/figures && bash bench/issue_figures.sh [LOG]
#
# Each bench's whole output goes to LOG (default: .farm/bench-figures.log, beside the demo's
# store), its exit status and wall time after it; the goals are in each bench's own lines.
# BENCH_QUICK=1 runs one trial of each (a look, not the figures). Took 49 minutes on 2 cores
# (2026-11-29).
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-.farm/bench-figures.log}
mkdir -p "$(dirname "$log")"
trials=3
[[ -n ${BENCH_QUICK:-} ]] && trials=1
: > "$log"

step() {  # step NAME COMMAND...: run it, its output and how it ended into the log
  local name=$1 began=$SECONDS status=0
  shift
  echo "== $name: $*" | tee -a "$log"
  "$@" >> "$log" 2>&1 || status=$?
  echo "== $name: exit $status after $((SECONDS - began)) s" | tee -a "$log"
}

demo_twice() {  # issue 36: ./dev demo's second run, 8 s or less (the first one sets up the venv)
  ./dev demo
  local TIMEFORMAT='./dev demo, second run: %1R s (goal: 8 s or less)'
  time ./dev demo
}

py=.venv/bin/python
echo "commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), $(nproc) cores" | tee -a "$log"
step demo demo_twice
step fanout $py bench/fanout.py --trials "$trials" --service --ceiling
step shared $py bench/shared.py --trials "$trials"
step gang $py bench/gang.py --pairs "$trials"
step remote_cache $py bench/remote_cache.py --rank-trials "$trials" --stock-trials "$trials"
echo "figures: grep -E 'goal|==' $log"
