#!/usr/bin/env bash
# Run every fuzz harness for SECONDS each (default 60), in turn, on a scratch copy of the seed
# corpora (new inputs land in $FUZZ_OUT, default /tmp/tierstore-fuzz; the seeds stay clean).
# Harness names may follow to run only those: fuzz/run.sh 600 record segment
#   TIERSTORE_FUZZ_NOCRC=1 also fuzzes the record decoder behind its checksum.
# Exit status: non-zero if any harness found a crash, a leak of an unexpected exception, a
# hang (-timeout) or excessive memory (-rss_limit_mb); the reproducer is in $FUZZ_OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"; shift || true
out="${FUZZ_OUT:-/tmp/tierstore-fuzz}"
py="${PYTHON:-.venv/bin/python}"
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(record segment meta codec recover reader)
status=0
for h in "${harnesses[@]}"; do
  case "$h" in reader) seeds=fuzz/corpus/segment ;; *) seeds="fuzz/corpus/$h" ;; esac
  mkdir -p "$out/$h"
  log="$out/$h.log"
  "$py" "fuzz/fuzz_$h.py" "$out/$h" "$seeds" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$out/$h-" -print_final_stats=1 >"$log" 2>&1
  rc=$?
  runs=$(grep -E "^stat::number_of_executed_units" "$log" | awk '{print $2}')
  cov=$(grep -oE "cov: [0-9]+" "$log" | tail -1)
  echo "$h: exit $rc, ${runs:-?} executions, ${cov:-cov: ?}, corpus $(ls "$out/$h" | wc -l) (log: $log)"
  [ $rc -eq 0 ] || { status=1; tail -20 "$log"; }
done
exit $status
