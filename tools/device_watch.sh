#!/usr/bin/env bash
# lab.py watch on the GPU machine: its GPU test, then the measured save-to-report times (tools/watch_demo.py).
# Writes to $OUT (default ./watch-out): test_watch_gpu.txt, watch_demo.txt, watch_times.json, watch_demo_*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-watch-out}
mkdir -p "$OUT"
python3 -m pytest -q -s -m gpu tests/test_watch_gpu.py 2>&1 | tee "$OUT/test_watch_gpu.txt"
test_status=${PIPESTATUS[0]}
python3 tools/watch_demo.py --out "$OUT" 2>&1 | tee "$OUT/watch_demo.txt"
demo_status=${PIPESTATUS[0]}
echo "test_watch_gpu: exit $test_status; watch_demo: exit $demo_status"
exit $(( test_status || demo_status ))
