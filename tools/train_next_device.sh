#!/usr/bin/env bash
# kernels/fused/train_next.cu on the device, in one run (about 4 minutes on an H200): its GPU tests
# against the array code and train.cu's path, then the training pass's profile with train.cu's kernels
# and with train_next.cu's (the mode `next` and its kernel table), GPT-2 small, bfloat16, 16 x 1024.
# Writes to $OUT: tests.txt (pytest's summary: "N passed" and no failure is a pass) and
# train_step_profile.txt / .json (the A/B: the rows fused and next, and the two kernel tables).
set -uo pipefail
OUT=${OUT:?set OUT to a folder}
cd "$(dirname "$0")/.."
timeout 150 python3 -m pytest -x -q -m gpu tests/test_train_next_gpu.py 2>&1 | tail -30 | tee "$OUT/tests.txt"
timeout 150 python3 tools/train_step_profile.py --kernels --next-kernels --repeats 3 --out "$OUT" 2>&1 \
    | tee "$OUT/train_step_profile.txt"
