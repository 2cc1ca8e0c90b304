#!/usr/bin/env bash
# Decode tokens/s and greedy tokens of this tree against an older one, in one run on the device: every
# GPT-2 size in float32 and bfloat16 and Llama 3.2 1B, 3B and 3.1 8B in bfloat16, random weights, a KV
# cache, as lab.py runs them (--json), the two trees alternating case by case (which one goes first
# alternates too, so that neither always runs on a warmer device).
#
#   git archive 9ca80c6 | tar -x -C .cache/before        the old tree, in an ignored folder
#   OUT=/tmp/out tools/decode_before_after.sh [.cache/before]
#
# Writes $OUT/decode_before_after.md (a table: decode tokens/s before and after, their ratio, whether
# the greedy tokens are identical, the engine's step) and $OUT/runs/*.json (each run's lab.py summary).
# TOKENS (default 256) new tokens per run; SIZES to run fewer cases ("gpt2:float32 llama-3.2-1b:bfloat16").
# Exit status 1 when any case's tokens differ or a run fails.
set -uo pipefail
BEFORE=$(cd "${1:-.cache/before}" && pwd)
AFTER=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/decode_before_after}
TOKENS=${TOKENS:-256}
SIZES=${SIZES:-"gpt2:float32 gpt2:bfloat16 gpt2-medium:float32 gpt2-medium:bfloat16 gpt2-large:float32
gpt2-large:bfloat16 gpt2-xl:float32 gpt2-xl:bfloat16 llama-3.2-1b:bfloat16 llama-3.2-3b:bfloat16
llama-3.1-8b:bfloat16"}
GPT2_IDS=15496,11,314,1101,257,3303,2746,11  # "Hello, I'm a language model,"
LLAMA_IDS=128000,791,4062,14198,39935,35308,927,279,16053,5679,13  # bench.py e2e's Llama prompt
mkdir -p "$OUT/runs"
[ -f "$BEFORE/lab.py" ] || { echo "decode_before_after: no lab.py in $BEFORE" >&2; exit 2; }

run() {  # tree label size dtype
    local ids=$GPT2_IDS
    [[ $3 == llama* ]] && ids=$LLAMA_IDS
    (cd "$1" && timeout 240 python3 lab.py --random-weights --kv-cache --tokens "$TOKENS" --size "$3" --dtype "$4" \
        --prompt-ids "$ids" --json "$OUT/runs/$3-$4-$2.json" > "$OUT/runs/$3-$4-$2.log" 2>&1) \
        || echo "  $2 failed: see $OUT/runs/$3-$4-$2.log" >&2
}

i=0
for case in $SIZES; do
    size=${case%%:*}; dtype=${case##*:}
    echo "$size $dtype" >&2
    if (( i % 2 == 0 )); then run "$BEFORE" before "$size" "$dtype"; run "$AFTER" after "$size" "$dtype"
    else run "$AFTER" after "$size" "$dtype"; run "$BEFORE" before "$size" "$dtype"; fi
    i=$((i + 1))
done

python3 - "$OUT" "$TOKENS" $SIZES <<'PY'
import json, sys
from pathlib import Path

out, tokens, cases = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows, bad = [], 0
for case in cases:
    size, dtype = case.split(":")
    runs = {}
    for tree in ("before", "after"):
        path = out / "runs" / f"{size}-{dtype}-{tree}.json"
        runs[tree] = json.loads(path.read_text()) if path.is_file() else None
    b, a = runs["before"], runs["after"]
    if b is None or a is None:
        bad += 1
        rows.append(f"| {size} | {dtype} | {'failed' if b is None else ''} | {'failed' if a is None else ''} | | | |")
        continue
    rb, ra = b["decode_tokens_per_second"], a["decode_tokens_per_second"]
    same = b["generated_tokens"] == a["generated_tokens"]
    bad += not same
    step = f"{a['engine']}, persistent {a['persistent']}, PDL {a['pdl']}"
    rows.append(f"| {size} | {dtype} | {rb:,.1f} | {ra:,.1f} | {ra / rb:.3f} | {'yes' if same else 'NO'} | {step} |")
head = next((json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))), {})
text = "\n".join([
    f"Decode tokens/s, before and after, {tokens} new tokens after a fixed prompt, random weights, KV cache "
    f"(lab.py --random-weights --kv-cache --json; one run each, the trees alternating). "
    f"Device: {head.get('device_name', '?')}.", "",
    "| size | dtype | before tok/s | after tok/s | after / before | greedy tokens identical | engine (after) |",
    "|---|---|---:|---:|---:|---|---|", *rows, ""])
(out / "decode_before_after.md").write_text(text)
print(text)
sys.exit(1 if bad else 0)
PY
