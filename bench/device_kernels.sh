#!/usr/bin/env bash
# One call on the GPU machine for the decode step's kernels: the tile/variant sweep, the captured decode
# step per batch with its kernel profile, and the kernel and GPU tests. Files under $OUT:
#   run.log, kernel_sweep.json, decode_step.json, decode_step.log, gpu_tests.log
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
timeout ${SWEEP_S:-240} python3 bench/kernel_sweep.py ${SWEEP_ARGS:-} --json "$OUT/kernel_sweep.json" | grep -E "BEST|Error|error"
timeout 200 python3 bench/decode_step.py --batches ${BATCHES:-1 2 4 8 16 32 64 128} --profile \
  --json "$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1
head -14 "$OUT/decode_step.log"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py tests/gpu/test_gpu.py \
  tests/engine/test_prefill_attention.py tests/engine/test_fused_router.py > "$OUT/gpu_tests.log" 2>&1
tail -15 "$OUT/gpu_tests.log"
