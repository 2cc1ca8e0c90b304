#!/usr/bin/env bash
# The backward ladder on one GPU, in one device call (191 s on an H200 for b08 and b09 on 2026-11-30:
# the tests 29 s, the sanitizer 45, the two timed runs 50 and 40, sass 27): every GPU test of the
# backward rungs, after the newer rung's register budget and one GPU test of it (a hang stops the run
# in 45 s, not in every step's limit); the newest rung under compute-sanitizer (one shape, the four tools at once); the two
# newest bfloat16 rungs timed together at every case (bench.py backward --interleave, twice, the order
# reversed, for bench.py compare); the newest rung's SASS, where its warps' stall samples fall
# (bench.py sass --backward), at a d = 64 and a d = 128 shape; and, where the newest declares the
# STEP_TRACE diagnostic, its step cycle by cycle (tools/rung_trace.py) at both.
#
#     OUT=/tmp/out tools/device_backward.sh              the two newest rungs that take bfloat16
#     OUT=/tmp/out tools/device_backward.sh b08 b09      an older rung and a newer one, by name
#
# A device call hands back only its output's tail and at most 8 files of $OUT, so every step writes its
# output into one log, a section a step, and each step has a time limit of its own, so that one that hangs
# leaves the others theirs (a sanitizer run stopped at its limit kills its children: tools/sanitize.py).
# Writes into $OUT: log.txt (every step's output, `== step` before each), sanitize-*.json,
# backward-*.json in bench-1/ and bench-2/, sass-*.json, rungtrace-*.json (one a traced case),
# compare.txt (bench.py compare of the two runs) and summary.txt (each step's exit status and seconds,
# printed at the end). Exits non-zero if any step failed or ran out of time.
set -u
: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [ $# -eq 0 ]; then
    set -- $(python3 -c "import kernels.backward as b; print(*[n for n in b.default_names() if 'bfloat16' in b.load(n).dtypes][-2:])")
fi
older="${1:?usage: tools/device_backward.sh [OLDER NEWER]}" newer="${2:?usage: tools/device_backward.sh [OLDER NEWER]}"
# Their full names (b08 -> b08_pingpong), as bench.py labels their rows.
names="$(python3 -c "
import sys, kernels.backward as b
try:
    print(*(b.load(n).name for n in sys.argv[1:]))
except ValueError as e:
    sys.exit(f'device_backward.sh: {e}')" "$older" "$newer")" || exit 2
read -r older_name newer_name <<< "$names"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-')"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
status=0

# step NAME LIMIT_SECONDS COMMAND...: the command under `timeout`, its output into its section of
# $OUT/log.txt, a line for summary.txt.
step() {
    local name="$1" limit="$2" log="$OUT/log.txt" began=$SECONDS code
    shift 2
    echo "== $name ($*)" >> "$log"
    timeout "$limit" "$@" >> "$log" 2>&1
    code=$?
    [ "$code" -eq 0 ] || status=1
    local verdict="exit $code"
    [ "$code" -eq 124 ] && verdict="ran past its limit of $limit s"
    printf '%-9s %-26s %4d s\n' "$name" "$verdict" $((SECONDS - began)) >> "$OUT/summary.txt"
    return "$code"
}

: > "$OUT/summary.txt"
: > "$OUT/log.txt"
echo "device ${device:-none}, rungs $older_name and $newer_name, commit $(git rev-parse --short HEAD 2>/dev/null)" >> "$OUT/summary.txt"

# First what can stop a new rung cheaply, so that a hang costs seconds, not every step's limit: its
# register request against the block's pool (tests/test_register_budget.py, NVRTC, no GPU: a request past
# it hangs in setmaxnreg), then its GPU test after a forward rung, in bfloat16, under 45 s. Either failing
# ends the run here (pytest's 5, no test chosen, passes: a rung without setmaxnreg or bfloat16).
chosen='"$@"; code=$?; [ "$code" -eq 5 ] && exit 0; exit "$code"'  # run "$@", pytest's 5 as 0
if ! step budget 120 bash -c "$chosen" _ python3 -m pytest -q -p no:cacheprovider tests/test_register_budget.py \
        -k "$newer_name" \
    || ! step smoke 45 bash -c "$chosen" _ python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_backward_gpu.py \
        -k "$newer_name and bfloat16 and after_a_forward_rung"; then
    echo "stopped: the newer rung failed its register budget or its first GPU test (log.txt)" >> "$OUT/summary.txt"
    cat "$OUT/summary.txt"
    exit 1
fi

# About 15 s on an H200 with -n 8 (each rung's configurations compiled once per worker).
step tests 240 python3 -m pytest -q -n 8 -m gpu tests/test_backward_gpu.py --durations=10

step sanitize 120 python3 tools/sanitize.py --only "$newer_name" --quick --parallel --timeout 100 \
    --json "$OUT/sanitize-$newer_name-${device:-nogpu}-$stamp.json"

# About a minute each: 14 cases, each rung beside its deterministic run, SDPA cuDNN's backward as the peer.
for run in 1 2; do
    order="$older,$newer"
    [ "$run" -eq 2 ] && order="$newer,$older"
    step "bench $run" 180 python3 bench.py backward --dtype bfloat16 --kernels "$order" \
        --cases gpt2,d128,noncausal,gqa,long --peers sdpa_cudnn --interleave --budget-ms 100 --results "$OUT/bench-$run"
done

# The head sizes the newer rung takes (b10 takes only d = 128): its SASS and its trace at those.
heads="$(python3 -c "import sys, kernels.backward as b; print(*b.load(sys.argv[1]).head_sizes())" "$newer_name")"
sass_cases="" trace_cases=()
case " $heads " in *" 64 "*) sass_cases="16x12x2048-d64" trace_cases+=("16x12x2048-d64");; esac
case " $heads " in *" 128 "*) sass_cases="${sass_cases:+$sass_cases,}2x32x4096-d128"
                              trace_cases+=("4x16x4096-d128-noncausal --timeline 4");; esac
step sass 150 python3 bench.py sass --backward "$newer" --cases "$sass_cases" --results "$OUT"

# Where the newer rung's step goes, cycle by cycle, if it declares the STEP_TRACE diagnostic (b08 and its
# copies): about 15 s a case, a rungtrace-*.json each in $OUT.
if grep -q '#ifndef STEP_TRACE' "kernels/backward/$newer_name.cu" 2>/dev/null; then
    for case in "${trace_cases[@]}"; do
        # shellcheck disable=SC2086  # the case carries its own options
        step trace 60 python3 tools/rung_trace.py --kernel "$newer_name" --case $case --results "$OUT"
    done
fi

if ls "$OUT"/bench-1/backward-*.json "$OUT"/bench-2/backward-*.json > /dev/null 2>&1; then
    python3 bench.py compare --of "$newer_name" --over "$older_name" \
        "$OUT"/bench-1/backward-*.json "$OUT"/bench-2/backward-*.json > "$OUT/compare.txt" 2>&1 || status=1
fi
cat "$OUT/summary.txt"
exit $status
