#!/usr/bin/env bash
# train.py --graph on one GPU, for a short device run: the graph's losses against the eager path's
# (tests/test_train_graph_gpu.py, ten steps each, float32 and bfloat16, one micro-batch and two), the
# multi-tensor AdamW's GPU tests (its step now reads its scalars from device memory), then
# the A/B of the whole step eager against its graph's replay at GPT-2 small, bfloat16, B x T = 16 x 1024.
#
#     OUT=/tmp/out tools/train_graph_device.sh      (from the repository root; about 4 minutes on an H200)
#
# Writes into $OUT: test_train_graph_gpu.txt and test_adamw_gpu.txt (pytest -s: each case's graph-vs-eager
# error, bit-identical steps, peak memory and ms), profile-bfloat16.txt and train_step_profile.json
# (tools/train_step_profile.py --graph --kernels: the step's ms eager and replayed, the replay's kernel
# table: wall against GPU busy), and train-graph.txt (train.py --graph's progress lines). Exits non-zero if
# a test failed or a run did.
set -u
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
status=0

# About 2 minutes: 11 runs of train.py (ten GPT-2 small steps at 4 x 256), compilation on the first.
python3 -m pytest -q -s -m gpu tests/test_train_graph_gpu.py -x 2>&1 | tee "$OUT/test_train_graph_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 -m pytest -q -m gpu tests/test_adamw_gpu.py -x 2>&1 | tee "$OUT/test_adamw_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# About a minute: the profile's modes, then the whole step eager and replayed, 5 repeats each.
python3 tools/train_step_profile.py --graph --kernels --out "$OUT" 2>&1 | tee "$OUT/profile-bfloat16.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# About 30 s: train.py itself, 20 steps with the graph (progress lines: ms per step after the capture).
python3 - <<'PY' > "$OUT/tokens.npy.log" 2>&1
import numpy as np, os
np.save(os.path.join(os.environ["OUT"], "tokens.npy"), np.random.default_rng(0).integers(0, 50257, 400_000))
PY
python3 train.py --random-weights --size gpt2 --dtype bfloat16 --data "$OUT/tokens.npy" --batch 16 --seq 1024 \
    --steps 20 --warmup 5 --graph --json "$OUT/train-graph.json" 2>&1 | tee "$OUT/train-graph.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
rm -f "$OUT/tokens.npy"
exit $status
