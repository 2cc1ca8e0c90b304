#!/usr/bin/env bash
# The backward ladder on one GPU, for a short device run: every GPU test of the backward rungs, then two
# small bench.py backward runs: b02 (float32) at every GPT-2 length and d = 128, for its error by T against
# the bound of FlashAttention's rule, and b05 (bfloat16) beside its deterministic run, for the cost of
# summing dQ in a fixed order.
#
#     OUT=/tmp/out tools/device_backward.sh      (from the repository root; about 6 minutes on an H200)
#
# Writes into $OUT: test_backward_gpu.txt (pytest, the 15 slowest tests last), bench-*.txt (each table),
# results/backward-*.json, and errors.txt: for each rung's row, each gradient's max error over its bound
# (at most 1: within the rule). Exits non-zero if a test failed or a bench run did.
set -u
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT/results"
status=0

# About 3-4 minutes, most of it NVRTC compiling the rungs' 32 configurations and the forward rungs.
python3 -m pytest -q -m gpu tests/test_backward_gpu.py -x --durations=15 2>&1 | tee "$OUT/test_backward_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# About a minute each: 7 cases, the rung and its deterministic run (plus SDPA cuDNN's backward in bfloat16).
python3 bench.py backward --dtype float32 --kernels b02 --cases gpt2,d128 --peers none --budget-ms 50 \
    --results "$OUT/results" 2>&1 | tee "$OUT/bench-float32-b02.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 bench.py backward --dtype bfloat16 --kernels b05 --cases gpt2,d128 --peers sdpa_cudnn --budget-ms 50 \
    --results "$OUT/results" 2>&1 | tee "$OUT/bench-bfloat16-b05.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

python3 - "$OUT/results" <<'EOF' | tee "$OUT/errors.txt"
import json, sys
from pathlib import Path

print("case, row: max error / bound of dq, dk, dv (FlashAttention's rule: at most 1)")
for path in sorted(Path(sys.argv[1]).glob("backward-*.json")):
    for r in json.loads(path.read_text())["rows"]:
        if r["kind"] == "rung" and "bound" in r:
            s = r["shape"]
            ratios = " / ".join(f"{r['max_err'][g] / r['bound'][g]:.2f}" for g in ("dq", "dk", "dv"))
            print(f"{s['B']}x{s['NH']}x{s['T_q']} d={s['d']} {r['dtype']}, {r['name']}: {ratios} ({r['status']})")
EOF
exit $status
