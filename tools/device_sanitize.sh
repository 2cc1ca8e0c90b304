#!/usr/bin/env bash
# One device call of the sanitizer run: a group of targets (or --quick over all of them) under all four tools,
# the table on stdout and the json in $OUT (or results/ without $OUT), named after the group.
#
#   tools/device_sanitize.sh quick          every target, one launch a rung (--quick), the four tools at once
#   tools/device_sanitize.sh forward        a group: forward, backward, triton, fused, step, llama, train
#   tools/device_sanitize.sh 'v0*,v1*'      any --only spec (the forward group split in two: 'v0*,v1*' and 'v2*')
#   tools/device_sanitize.sh repro          v17's synccheck reproducer (both barrier forms) and v17/v23's device tests
#   tools/device_sanitize.sh initcheck      whether initcheck sees cuBLAS's stores, under each way of treating its
#                                           kernels (tools/initcheck_library.py; two or three minutes)
#   tools/device_sanitize.sh ring           decode_step's racecheck reproducer (tools/racecheck_ring.py), its cases' sums
#   tools/device_sanitize.sh all            every group at once (the forward in three: 'v0*', 'v1*', 'v2*'; train
#                                           in its two halves), each its own process; ~9 minutes on an H200's 16
#                                           cores before every rung also ran at its other head sizes (longer now,
#                                           not yet timed: split it over calls), each group's seconds longer than
#                                           alone. Run `initcheck` first
#                                           (its own device call) and pass the mode its last line names.
#
# The json's "seconds" holds each target's wall time under each tool: the groups to split a full run by.
# INITCHECK_LIBRARY=zeroed|excluded|checked|small-workspace (default zeroed) is passed on as --initcheck-library.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:?usage: tools/device_sanitize.sh quick|GROUP|SPEC|repro|initcheck|ring|all}"
out="${OUT:-results}"
mkdir -p "$out"
label="$(echo "$what" | tr -c 'A-Za-z0-9_-' '_' | sed 's/_*$//')"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-')"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
file="$out/sanitize-$label-${device:-nogpu}-$stamp.json"
library="--initcheck-library ${INITCHECK_LIBRARY:-zeroed}"
case "$what" in
  all)
    for group in backward triton fused step llama train-float32 train-bfloat16 'v0*' 'v1*' 'v2*'; do
      "$0" "$group" > "$out/sanitize-$(echo "$group" | tr -c 'A-Za-z0-9_-' '_').log" 2>&1 &
    done
    wait
    tail -n 25 "$out"/sanitize-*.log ;;
  quick) python3 tools/sanitize.py --quick --parallel --timeout 420 $library --json "$file" ;;
  initcheck) python3 tools/initcheck_library.py --timeout 60 | tee "$out/initcheck-library-${device:-nogpu}-$stamp.txt" ;;
  repro)
    python3 tools/synccheck_cluster.py --timeout 120 | tee "$out/synccheck-cluster-${device:-nogpu}-$stamp.txt"
    python3 -m pytest -q -m gpu tests/test_sanitize_gpu.py ;;
  ring)
    python3 tools/racecheck_ring.py --timeout 300 | tee "$out/racecheck-ring-${device:-nogpu}-$stamp.txt"
    python3 -m pytest -q -m gpu tests/test_racecheck_ring.py ;;
  forward|backward|triton|fused|step|llama|train)
    python3 tools/sanitize.py --group "$what" --timeout 420 $library --json "$file" ;;
  *) python3 tools/sanitize.py --only "$what" --timeout 420 $library --json "$file" ;;
esac
