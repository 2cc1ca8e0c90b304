#!/usr/bin/env bash
# Training on the device, each mode within one device command (10 minutes); logs and result files under $OUT
# (default ./out).
#
#   tools/train_device.sh                  the GPU tests of training (tests/test_gpt2_backward_gpu.py,
#                                          tests/test_train_gpu.py; ~3-4 min, most of it compiling the rungs),
#                                          then bench.py train --quick (bfloat16, B = 16, every backward rung
#                                          and both torch peers; ~3 min, half of it torch.compile)
#   tools/train_device.sh full bfloat16    bench.py train's bfloat16 table: B = 16 and the largest B that fits,
#                                          the loss curve (~5 min)
#   tools/train_device.sh full float32     its float32 table, TF32 off (~5-6 min)
#   tools/train_device.sh adamw            the multi-tensor AdamW: tests/test_adamw_gpu.py (bit for bit the
#                                          per-tensor path), then tools/train_step_profile.py (the pass, and
#                                          the optimizer per tensor and multi-tensor) (~2-3 min)
#
# The full runs' result files (and the bfloat16 run's loss-curve PNG) go into results/; bench.py readme then
# writes docs/training.md's table from the newest full run of each dtype. Exit status: nonzero if any step failed.
set -u -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-check}" in
  check)
    python3 -m pytest -q -s -rs --durations=15 tests/test_gpt2_backward_gpu.py tests/test_train_gpu.py 2>&1 \
      | tee "$OUT/train_tests.log"
    tests=$?
    python3 bench.py train --quick --results "$OUT" 2>&1 | tee "$OUT/bench_train_quick.log"
    bench=$?
    exit $(( tests || bench ))
    ;;
  full)
    dtype=${2:?usage: tools/train_device.sh full bfloat16|float32}
    python3 bench.py train --dtypes "$dtype" --results "$OUT" 2>&1 | tee "$OUT/bench_train_$dtype.log"
    ;;
  adamw)
    python3 -m pytest -q -s -rs tests/test_adamw_gpu.py 2>&1 | tee "$OUT/adamw_tests.log"
    tests=$?
    python3 tools/train_step_profile.py --out "$OUT" 2>&1 | tee "$OUT/train_step_profile.log"
    profile=$?
    exit $(( tests || profile ))
    ;;
  *)
    echo "usage: tools/train_device.sh [check | full bfloat16 | full float32 | adamw]" >&2
    exit 2
    ;;
esac
