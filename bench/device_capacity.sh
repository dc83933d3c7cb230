#!/usr/bin/env bash
# One call on the GPU machine for the final-build report: the GPU tests (run while the server starts and
# captures its graphs; they assert results, not speed), a full-size server (random weights), the
# live-capacity benchmark with a clone per request (one clip re-sent, and a distinct clip each time) and
# with a stored voice, the seed's table
# (bench/ws_bench.py) and the same request without a voice at c=1, py-spy of the engine and the gateway
# under load, then, with the GPU to itself again, the captured decode step per batch and its profile.
# At most 8 files come back, so everything goes into these under $OUT:
#   run.log, capacity_clone.json, capacity_voice.json, ws_bench.json, pyspy_engine.txt, pyspy_gateway.txt,
#   gpu_tests.log, decode_step.log
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -m app --random-weights full --port 8000 --data-dir /tmp/data --no-text-normalization ${SERVER_ARGS:-} \
  > /tmp/server.log 2>&1 &
server=$!
timeout 280 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
  tests/test_prefill_attention.py tests/test_fused_router.py > "$OUT/gpu_tests.log" 2>&1 &
tests=$!
for _ in $(seq 300); do curl -sf localhost:8000/readyz > /dev/null && break; sleep 1; done
curl -s localhost:8000/readyz | head -c 800; echo
grep -E "captured|KV cache|warmed" /tmp/server.log
wait $tests
tail -4 "$OUT/gpu_tests.log"
CAP="python3 bench/live_capacity.py --duration ${DURATION:-12} --warmup ${WARMUP:-4} --stop-after-fail 2"
timeout 200 $CAP --levels ${LEVELS:-48 64 96 128 160} --out "$OUT/capacity_clone.json"
timeout 90 $CAP --levels ${VOICE_LEVELS:-96 128} --voice bench-voice --out "$OUT/capacity_voice.json"
# every request with a clip the gateway has not embedded yet (its table goes to run.log)
timeout 90 $CAP --levels ${DISTINCT_LEVELS:-32 64} --distinct-clips
# the profiled level: engine and gateway threads, and the gateway's CPU share
epid=$(curl -s localhost:8000/readyz | python3 -c "import json,sys; print(json.load(sys.stdin)['engine']['pid'])")
$CAP --levels ${PROFILE_LEVEL:-128} --duration 14 --out /tmp/prof.json > /tmp/prof.log 2>&1 &
bench=$!
sleep 8
t0=$(awk '{print $14+$15}' /proc/$server/stat)
py-spy record --format raw --nonblocking -d 8 -p "$epid" -o "$OUT/pyspy_engine.txt" > /dev/null 2>&1 &
spy=$!
py-spy record --format raw --nonblocking -d 8 -p "$server" -o "$OUT/pyspy_gateway.txt" > /dev/null 2>&1
wait $spy
t1=$(awk '{print $14+$15}' /proc/$server/stat)
echo "gateway CPU over the profiled 8 s at level ${PROFILE_LEVEL:-128}: $(( (t1 - t0) * 100 / $(getconf CLK_TCK) / 8 )) % of a core"
wait $bench
tail -4 /tmp/prof.log
timeout 150 python3 bench/ws_bench.py --concurrency 1 2 4 8 --requests ${REQS:-30} --json "$OUT/ws_bench.json"
# the same request without a voice: is first audio as fast as with a clone?
timeout 60 python3 bench/ws_bench.py --concurrency 1 --requests ${REQS:-30} --no-clone
curl -s localhost:8000/metrics | grep -E "^zonos_engine_(step|period|headroom)_ms "
kill $server; sleep 3
grep -v -E "GET /readyz|WebSocket /v1|connection (open|closed)| rid [0-9]+ done" /tmp/server.log | tail -15
timeout ${DECODE_STEP_S:-150} python3 bench/decode_step.py --batches ${BATCHES:-1 2 4 8 16 32 64 128} --profile \
  > "$OUT/decode_step.log" 2>&1
head -14 "$OUT/decode_step.log"
