#!/usr/bin/env bash
# Training on the device: the GPU tests of train.py (parity with PyTorch, transformers loading --out), then
# bench.py train. Writes the logs, the result file and the loss curve under $OUT (default ./out).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pytest -x -q -s tests/test_train_gpu.py tests/test_train.py 2>&1 | tee "$OUT/tests.log"
python3 bench.py train --results "$OUT" 2>&1 | tee "$OUT/bench_train.log"
