#!/usr/bin/env bash
# Warp stall reasons of Llama's decode attention (gqa_decode_attention) under ncu, in the engine's own
# graph: a Llama 3.2 1B engine (random weights, bfloat16, a 512-position cache) replays a graph of 8
# steps from position 253, and ncu profiles two of its attention launches, once with the caches
# flushed before each (--cache-control all) and once warm (none). ncu serializes the kernels, so the
# time is the kernel alone, without the overlap programmatic dependent launch gives it in the step.
#
#   OUT=/tmp/out tools/attention_ncu.sh [SIZE]        writes $OUT/ncu-gqa-attention-{flushed,warm}.csv
set -euo pipefail
OUT=${OUT:-/tmp/attention_ncu}
SIZE=${1:-llama-3.2-1b}
case $SIZE in llama-3.2-1b|llama-3.2-3b|llama-3.1-8b) ;; *) echo "attention_ncu: $SIZE: not a Llama size" >&2; exit 2 ;; esac
command -v ncu > /dev/null || { echo "attention_ncu: no ncu here: run it on the GPU machine" >&2; exit 2; }
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
DRIVER="
import cupy
import llama.fast as fast
from benchmarks import scale
fam = scale.of_size('$SIZE')
ckpt = fam.random_weights('$SIZE', seed=0, xp=cupy, dtype='bfloat16')
fam.decode_layout(ckpt.params, ckpt.config)
engine = fast.Engine(ckpt.params, ckpt.config, max_len=512)
print('plan', vars(engine.attn))
engine.replay_ms(253, 8, repeats=2)
cupy.cuda.Device().synchronize()
"
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active'
for mode in flushed:all warm:none; do
    PYTHONPATH=$PWD ncu --cache-control "${mode#*:}" --kernel-name regex:gqa_decode_attention --launch-skip 40 \
        --launch-count 2 --metrics "$METRICS" --csv python3 -c "$DRIVER" > "$OUT/ncu-gqa-attention-${mode%%:*}.csv"
    echo "wrote $OUT/ncu-gqa-attention-${mode%%:*}.csv"
done
