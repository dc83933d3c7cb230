#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the decode-step, prefill and MoE microbenchmarks, then the
# end-to-end WebSocket benchmark against a server on full-size random weights. Logs go to $OUT.
# Usage (device tool): bash bench/device_run.sh [tests] [micro] [prefill] [moe] [dac] [capacity] [e2e]
# (default: all but capacity)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
steps=${*:-tests micro prefill moe dac e2e}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests)
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_kernels.py tests/gpu/test_gpu.py \
        tests/engine/test_prefill_attention.py tests/engine/test_fused_router.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    micro)
      timeout 300 python3 bench/decode_step.py --batches 1 2 4 8 16 32 64 ${MICRO_ARGS:-} --json "$OUT/decode.json" 2>&1 \
        | tee "$OUT/decode.log" | grep -v "^\s*$" | tail -70 ;;
    prefill)
      timeout 200 python3 bench/prefill_step.py --prompts 1 2 4 --json "$OUT/prefill.json" 2>&1 \
        | tee "$OUT/prefill.log" | grep prefill ;;
    moe)
      timeout 200 python3 bench/moe_sweep.py 2>&1 | tee "$OUT/moe_sweep.log" | grep BEST ;;
    dac)
      timeout 300 python3 bench/dac_step.py --json "$OUT/dac.json" 2>&1 | tee "$OUT/dac.log" | tail -30 ;;
    capacity)
      # live capacity (bench/live_capacity.py) against a full-size server; SERVER_ARGS picks its flags,
      # then one more level under py-spy (engine and gateway threads)
      python3 -m app --random-weights full --port 8000 --data-dir /tmp/data --no-text-normalization \
        ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
      for _ in $(seq 300); do curl -sf localhost:8000/readyz > /dev/null && break; sleep 1; done
      curl -s localhost:8000/readyz | head -c 800; echo
      timeout ${CAP_TIMEOUT:-360} python3 bench/live_capacity.py --levels ${LEVELS:-16 64 96 128 160} \
        --duration ${DURATION:-15} --warmup ${WARMUP:-5} --stop-after-fail ${STOP_AFTER:-2} \
        --out "$OUT/${CAP_NAME:-capacity}.json" 2>&1 | tee "$OUT/${CAP_NAME:-capacity}.log"
      if [ -n "${PROFILE_LEVEL:-}" ]; then
        epid=$(curl -s localhost:8000/readyz | python3 -c "import json,sys; print(json.load(sys.stdin)['engine']['pid'])")
        gpid=$(pgrep -f "python3 -m app" | head -1)
        python3 bench/live_capacity.py --levels $PROFILE_LEVEL --duration 14 --warmup 4 --out /tmp/prof.json \
          > "$OUT/profile_level.log" 2>&1 &
        bench_pid=$!
        sleep 8
        py-spy record --format raw --nonblocking -d 8 -p "$epid" -o "$OUT/pyspy_engine.txt" > /dev/null 2>&1 &
        spy_pid=$!
        py-spy record --format raw --nonblocking -d 8 -p "$gpid" -o "$OUT/pyspy_gateway.txt" > /dev/null 2>&1
        wait $spy_pid $bench_pid
        tail -3 "$OUT/profile_level.log"
      fi
      curl -s localhost:8000/metrics | grep -E "^zonos_engine" | tee "$OUT/metrics_capacity.txt"
      kill %1; sleep 2; grep -E "captured|KV cache|warmed|ready|Error|error" "$OUT/server.log" | grep -v readyz | head -20 ;;
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
