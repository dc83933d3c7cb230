#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the decode-step, prefill and MoE microbenchmarks, then the
# end-to-end WebSocket benchmark against a server on full-size random weights. Logs go to $OUT.
# Usage (device tool): bash bench/device_run.sh [tests] [micro] [prefill] [moe] [e2e]   (default: all)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
steps=${*:-tests micro prefill moe e2e}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests)
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
        tests/test_prefill_attention.py tests/test_fused_router.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    micro)
      timeout 300 python3 bench/decode_step.py --batches 1 2 4 8 16 32 64 ${MICRO_ARGS:-} --json "$OUT/decode.json" 2>&1 \
        | tee "$OUT/decode.log" | grep -v "^\s*$" | tail -70 ;;
    prefill)
      timeout 200 python3 bench/prefill_step.py --prompts 1 2 4 --json "$OUT/prefill.json" 2>&1 \
        | tee "$OUT/prefill.log" | grep prefill ;;
    moe)
      timeout 200 python3 bench/moe_sweep.py 2>&1 | tee "$OUT/moe_sweep.log" | grep BEST ;;
    e2e)
      python3 -m app --random-weights full --port 8000 --data-dir /tmp/data --no-text-normalization \
        > "$OUT/server.log" 2>&1 &
      for _ in $(seq 240); do curl -sf localhost:8000/readyz > /dev/null && break; sleep 1; done
      curl -s localhost:8000/readyz | head -c 600; echo
      timeout ${E2E_TIMEOUT:-330} python3 bench/ws_bench.py --concurrency ${CONC:-1 2 4 8 16 32 64} \
        --requests ${REQS:-100} --json "$OUT/ws_bench.json" 2>&1 | tee "$OUT/ws_bench.log"
      curl -s localhost:8000/metrics | grep -E "^zonos_engine|^zonos_time_to_first_audio_seconds_(sum|count)" \
        | tee "$OUT/metrics.txt"
      kill %1; sleep 1; tail -5 "$OUT/server.log" ;;
  esac
done
