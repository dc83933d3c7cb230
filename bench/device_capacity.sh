#!/usr/bin/env bash
# One call on the GPU machine for the capacity report: the GPU tests (run while the server starts and
# captures its graphs; they assert results, not speed), a full-size server (random weights) whose engine
# profiles one iteration's GPU time by node once PROFILE_STREAMS streams decode (engine/runtime/profile.py; in a
# level of PROFILE_LEVEL offered streams that is not counted: set PROFILE_LEVEL= to skip it; several levels, e.g.
# PROFILE_LEVEL="1 64 128 192", profile each: the before/after table of docs/benchmarks.md),
# live capacity with a clone per request (one clip re-sent) and with a distinct clip each time, the overload
# case (OVERLOAD streams offered for OVERLOAD_S seconds), then the seed's table (bench/ws_bench.py, c = 1..8).
# At most 8 files come back, so everything goes into these under $OUT:
#   run.log, gpu_tests.log, capacity_clone.json, capacity_distinct.json, capacity_sentences.json, overload.json,
#   iteration_profile.json, ws_bench.json (the server's log stays there: 8 files at most come back)
# storm.json (STORM), storm_distinct.json (STORM_DISTINCT), capacity_words.json (WORDS_LEVELS), capacity_estimated.json (ESTIMATED_LEVELS) and
# capacity_agent.json (AGENT_LEVELS) come on top: set others empty to make room (e.g.
# AGENT_LEVELS="96 128" SENTENCE_LEVELS=); a plan of more than 8 files stops before the server starts. So do:
# REFUSE_STORM=10000 throws that many refused connections over a level of REFUSE_LEVELS (default 192, at or above
# capacity so that the door is closed) after the same level without them (refuse_storm.json: the admitted
# streams' stall rate and first audio with and without, the refusals' latency); CPU_LEVELS="64 128 192" measures
# the gateway processes' CPU per live stream for pcm and mp3 answers of POST /v1/audio/speech (cpu_pcm_s16le.json,
# cpu_mp3.json); GATEWAY_CPU=1 adds it to the capacity levels of our socket (pcm). Every level reports the
# gateway's collector pauses (gc: p50 / p99 / the longest's bucket).
# PYTEST_ARGS adds pytest options (-rP: the passed tests' printed figures, e.g. the DAC SNRs). SERVER_ARGS adds
# server flags, e.g. SERVER_ARGS=--no-overlap-decode for decode steps without overlap scheduling (on by
# default with a GPU): compare its iteration profile's idle time and capacity with a default run. CAP_ARGS adds
# bench/live_capacity.py flags to the capacity levels, e.g. CAP_ARGS=--timestamps (word times on; with
# SERVER_ARGS="--aligner FILE" aligned ones too: a checkpoint of MMS_FA's format, engine/aligner/model.py).
# CLIENT_PROCS sets every live_capacity.py call's --client-procs: its clients spread over that many processes, each
# with its own event loop, so the client's own loop lag is not measured as stalls (default 0: one per 32 clients, at
# most one per CPU; every level reports each process's loop lag).
# ZONOS_FP8_TILE (with SERVER_ARGS=--quantization fp8) serves the FP8 experts with a tile variant as
# bench/fp8_fidelity.py --sweep names it (its `best`), e.g. ZONOS_FP8_TILE="swap m16 n128 w4 s4".
# SERVER_CPUS / CLIENT_CPUS (taskset lists, e.g. SERVER_CPUS=0-9 CLIENT_CPUS=10-15) pin the server (engine and
# gateway processes) and the clients to their own cores, as clients on other machines would be: a storm's client
# processes then no longer take the gateways' cores (their wall-clock collector pauses and refusal latency then
# measure the server, and the clients' loop lag their own cores); the gateway's --workers default follows the
# server's CPUs (one per four).
# ENGINE_CPUS (a CPU list within SERVER_CPUS, e.g. SERVER_CPUS=0-7 ENGINE_CPUS=7) adds --engine-cpus: the engine process
# (its loop and side threads) runs on those CPUs alone, the gateway processes and their workers on the rest of the
# server's (docs/architecture.md "CPUs"); /readyz's engine.cpus and gateway.cpus say where each runs. Measured on
# 57e543a (H200, STORM_DISTINCT=512 with the same SERVER_CPUS=0-7, SERVER_ARGS and --workers 4): ENGINE_CPUS=7 was
# worse than unset (99.9 vs 100 % stall-free, loop preempted 5,713 vs 334x): the engine's side threads share its core.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
planned=2  # run.log, capacity_clone.json
for x in "${TESTS-x}" "${PROFILE_LEVEL-128}" "${DISTINCT_LEVELS-128}" "${SENTENCE_LEVELS-64}" "${STORM:-}" \
  "${OVERLOAD-256}" "${REQS-30}" "${AGENT_LEVELS:-}" "${STORM_DISTINCT:-}" "${REFUSE_STORM:-}" "${CPU_LEVELS:-}" "${CPU_LEVELS:-}" \
  "${WORDS_LEVELS:-}" "${ESTIMATED_LEVELS:-}"; do
  [ -n "$x" ] && planned=$((planned + 1)); done  # (CPU_LEVELS: two files, pcm and mp3)
[ $planned -le 8 ] || { echo "device_capacity.sh: $planned files planned under \$OUT, 8 come back: set some empty"; exit 2; }
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
# the profile only with its own level (PROFILE_LEVEL= skips both): stopping the profiler holds the engine loop
# for seconds (3.5-4.2 s on an H200, docs/architecture.md), in whichever level it fires
# PROFILE_LEVEL="1 64 128 192" profiles each level in turn (one file, iteration_profile.json, keyed by threshold);
# the thresholds: PROFILE_STREAMS, else 86 % of each level (110 of 128: what a ramped level keeps decoding)
plevels=(${PROFILE_LEVEL-128})
pthresholds=(${PROFILE_STREAMS:-$(for l in "${plevels[@]}"; do t=$(( l * 86 / 100 )); echo $(( t > 0 ? t : 1 )); done)})
profile=(); [ ${#plevels[@]} -gt 0 ] && profile=(ZONOS_PROFILE="$OUT/iteration_profile.json" \
  ZONOS_PROFILE_STREAMS="${pthresholds[*]}")
SERVER_PIN=(); [ -n "${SERVER_CPUS:-}" ] && SERVER_PIN=(taskset -c "$SERVER_CPUS")
CLIENT_PIN=""; [ -n "${CLIENT_CPUS:-}" ] && CLIENT_PIN="taskset -c $CLIENT_CPUS"
ENGINE_PIN=(); [ -n "${ENGINE_CPUS:-}" ] && ENGINE_PIN=(--engine-cpus "$ENGINE_CPUS")
env "${profile[@]}" "${SERVER_PIN[@]}" python3 -m app --random-weights full --port 8000 --data-dir /tmp/data --no-text-normalization "${ENGINE_PIN[@]}" ${SERVER_ARGS:-} \
  > /tmp/server.log 2>&1 &
server=$!
# TESTS= (empty) runs no tests
if [ -n "${TESTS-tests/engine/test_kernels.py tests/gpu/test_gpu.py tests/engine/test_prefill_attention.py tests/engine/test_fused_router.py}" ]; then
  timeout -s INT -k 20 ${TESTS_S:-280} python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} \
    ${TESTS:-tests/engine/test_kernels.py tests/gpu/test_gpu.py tests/engine/test_prefill_attention.py tests/engine/test_fused_router.py} \
    > "$OUT/gpu_tests.log" 2>&1 &
  tests=$!
fi
for _ in $(seq ${READY_S:-400}); do curl -sf localhost:8000/readyz > /dev/null && break; sleep 1; done
curl -s localhost:8000/readyz | head -c 800; echo
grep -E "captured|KV cache|warmed|quantiz" /tmp/server.log
[ -n "${tests:-}" ] && { wait $tests; tail -4 "$OUT/gpu_tests.log"; }
# PYSPY_S=10: py-spy samples the engine's and the gateway's threads for that long in a level's measured window
# (the carried py-spy wheel): the first capacity level's, or with PYSPY_ON=words / storm the first WORDS_LEVELS /
# STORM level's;
# bench/stack_summary.py prints where their host time went
pyspy_start() {
  # the gateway: the process that answered readyz (one of --workers; the supervisor only supervises)
  read -r engine_pid gateway_pid < <(curl -s localhost:8000/readyz | python3 -c \
    "import json, sys; r = json.load(sys.stdin); print(r['engine']['pid'], r['gateway']['pid'])")
  (sleep $(( ${WARMUP:-4} + 3 ))
   for who in engine:$engine_pid gateway:$gateway_pid; do
     py-spy record --pid ${who#*:} -d $PYSPY_S -r 200 -f raw -o /tmp/pyspy_${who%%:*}.txt --nonblocking \
       > /tmp/pyspy_${who%%:*}.log 2>&1 &
   done; wait) &
  pyspy=$!
}
pyspy_report() {
  [ -n "${pyspy:-}" ] || return 0
  wait $pyspy
  for who in engine gateway; do
    echo "== py-spy, $who (${PYSPY_S} s at 200 Hz)"; tail -2 /tmp/pyspy_$who.log
    python3 bench/stack_summary.py /tmp/pyspy_$who.txt --wall $(( PYSPY_S * 200 )) --top 30
  done
  pyspy=
}
LIVE="$CLIENT_PIN python3 bench/live_capacity.py --client-procs ${CLIENT_PROCS:-0}"
CAP="$LIVE --duration ${DURATION:-12} --warmup ${WARMUP:-4} --stop-after-fail 2 ${CAP_ARGS:-}"
[ -n "${GATEWAY_CPU:-}" ] && CAP="$CAP --gateway-cpu"
# the iteration profile, in a level nobody counts: stopping the profiler holds the engine loop for seconds
# (4.2 s at 125 streams on the H200), a stall of every stream that the measured levels must not see; and its end:
# the profile fires once its threshold of streams decode, possibly late in that level, and its stop (on the engine
# loop) and its trace's export (on an engine thread that holds the GIL) hold the loop for seconds; the H200 runs of
# e813e5d and 7e5c175 had that 3-4 s hold in the first counted level (its late iteration and all its stalls), so the
# next level waits for the profile's file (written once the export is done), if the profile started
for i in "${!plevels[@]}"; do
  pfile="$OUT/iteration_profile.json"; [ ${#plevels[@]} -gt 1 ] && pfile="$OUT/iteration_profile-${pthresholds[$i]}.json"
  timeout 60 $LIVE --levels ${plevels[$i]} --duration 8 --warmup 2 --stop-after-fail 0 --out /tmp/profile_level.json \
    > /dev/null 2>&1
  if [ "$(grep -c "iteration profile: recording" /tmp/server.log)" -gt "$i" ]; then
    for _ in $(seq 90); do
      [ -s "$pfile" ] || grep -q "iteration profile failed" /tmp/server.log && break; sleep 1
    done
  fi
done
if [ ${#plevels[@]} -gt 1 ]; then  # one file keyed by threshold (at most 8 files come back)
  python3 -c "import json, pathlib, sys; o = pathlib.Path(sys.argv[1]); fs = sorted(o.parent.glob('iteration_profile-*.json'))
json.dump({f.stem.split('-')[-1]: json.loads(f.read_text()) for f in fs}, o.open('w'), indent=1); [f.unlink() for f in fs]" \
    "$OUT/iteration_profile.json"
fi
[ -n "${PYSPY_S:-}" ] && [ "${PYSPY_ON:-clone}" = clone ] && pyspy_start
timeout ${CLONE_S:-200} $CAP --levels ${LEVELS:-64 128 160 192} --out "$OUT/capacity_clone.json"
pyspy_report
[ -n "${DISTINCT_LEVELS-128}" ] && timeout ${DISTINCT_S:-90} $CAP --levels ${DISTINCT_LEVELS:-128} --distinct-clips \
  --out "$OUT/capacity_distinct.json"
# WORDS_LEVELS: the same levels with word timestamps on (session.config `timestamps`: estimated, and aligned when
# SERVER_ARGS has --aligner), the cost of word times beside LEVELS' figures without them
[ -n "${PYSPY_S:-}" ] && [ "${PYSPY_ON:-clone}" = words ] && [ -n "${WORDS_LEVELS:-}" ] && pyspy_start
[ -n "${WORDS_LEVELS:-}" ] && timeout ${WORDS_S:-120} $CAP --levels $WORDS_LEVELS --timestamps \
  --out "$OUT/capacity_words.json"
pyspy_report
# ESTIMATED_LEVELS: the same with `timestamps: "estimated"` (the streamed estimate only, never the aligner)
[ -n "${ESTIMATED_LEVELS:-}" ] && timeout ${WORDS_S:-120} $CAP --levels $ESTIMATED_LEVELS --timestamps estimated \
  --out "$OUT/capacity_estimated.json"
# replies of SENTENCES sentences, each continuing the one before (one DAC stream per reply)
# (SENTENCE_ARGS=--mixed: every other client sends single sentences beside them; the report gives the later
# sentences' prefill and first audio, and each kind's stall-free share)
[ -n "${SENTENCE_LEVELS-64}" ] && timeout ${SENTENCE_S:-90} $CAP --levels ${SENTENCE_LEVELS:-64} --sentences ${SENTENCES:-3} \
  ${SENTENCE_ARGS:-} --out "$OUT/capacity_sentences.json"
# voice-agent sessions (bench/agent_load.py): AGENT_LEVELS="96 128" sessions, each streaming replies of 4 sentences
# word by word at 30 words/s over one socket, played live turn after turn, AGENT_S measured seconds per level
# (AGENT_ARGS adds its flags, e.g. "--words-per-s 15 --sentences 3")
[ -n "${AGENT_LEVELS:-}" ] && timeout $(( $(wc -w <<< "$AGENT_LEVELS") * (${AGENT_S:-60} + 45) + 60 )) \
  $CLIENT_PIN python3 bench/agent_load.py --levels $AGENT_LEVELS --duration ${AGENT_S:-60} --warmup 10 --stop-after-fail 0 \
  ${AGENT_ARGS:-} --out "$OUT/capacity_agent.json"
[ -n "${PYSPY_S:-}" ] && [ "${PYSPY_ON:-clone}" = storm ] && [ -n "${STORM:-}" ] && pyspy_start
# storm: STORM="384 512" offered, a refused client retrying at once (live_capacity.py --storm): admitted streams
# must not stall and refusals must be fast (STORM_ARGS adds flags, e.g. --distinct-clips: a new clip per request)
[ -n "${STORM:-}" ] && timeout $(( $(wc -w <<< "$STORM") * (${STORM_S:-20} + 35) + 30 )) $LIVE --storm \
  --levels $STORM --duration ${STORM_S:-20} --warmup 5 --stop-after-fail 0 ${STORM_ARGS:-} --out "$OUT/storm.json"
pyspy_report
# STORM_DISTINCT="256 384 512": the same storm with a new clip per request (storm_distinct.json), after STORM's
[ -n "${STORM_DISTINCT:-}" ] && timeout $(( $(wc -w <<< "$STORM_DISTINCT") * (${STORM_S:-20} + 35) + 30 )) $LIVE --storm \
  --levels $STORM_DISTINCT --duration ${STORM_S:-20} --warmup 5 --stop-after-fail 0 --distinct-clips ${STORM_ARGS:-} \
  --out "$OUT/storm_distinct.json"
# refusal storm: REFUSE_STORM refused connections (raw sockets from REFUSE_PROCS client processes, every API's
# upgrade and a synthesis POST) over a storm level of REFUSE_LEVELS, which runs first without them
[ -n "${REFUSE_STORM:-}" ] && timeout $(( (${REFUSE_S:-20} + 10) * 2 * $(echo ${REFUSE_LEVELS:-192} | wc -w) + 60 )) \
  $LIVE --storm --levels ${REFUSE_LEVELS:-192} --duration ${REFUSE_S:-20} --warmup 5 \
  --stop-after-fail 0 --refuse-storm $REFUSE_STORM --refuse-procs ${REFUSE_PROCS:-4} --refuse-concurrency \
  ${REFUSE_CONCURRENCY:-128} --gateway-cpu --out "$OUT/refuse_storm.json"
# gateway CPU per live stream (every gateway process from /proc) at CPU_LEVELS, pcm and mp3 answers, stored voice
if [ -n "${CPU_LEVELS:-}" ]; then
  for enc in pcm_s16le mp3; do
    timeout $(( (${CPU_S:-12} + 8) * $(echo $CPU_LEVELS | wc -w) + 60 )) $LIVE --api speech \
      --encoding $enc --voice cpu-bench --levels $CPU_LEVELS --duration ${CPU_S:-12} --warmup 4 --stop-after-fail 0 \
      --gateway-cpu --out "$OUT/cpu_$enc.json"
  done
fi
# overload: far more offered than fits; admitted streams must not stall, the rest are answered
[ -n "${OVERLOAD-256}" ] && timeout $(( ${OVERLOAD_S:-60} + 60 )) $LIVE \
  --levels ${OVERLOAD:-256} --duration ${OVERLOAD_S:-60} --warmup 5 --stop-after-fail 0 --out "$OUT/overload.json"
curl -s localhost:8000/metrics | grep -E "^zonos_engine_(step|period|headroom)_ms |^zonos_engine_(plain_period|sprint_cost)_ms_by|^zonos_engine_paced|^zonos_engine_admission_held"
grep -E "slow iteration|decode steps paused|gc pause|Traceback|recompil" /tmp/server.log | head -30
[ -n "${REQS-30}" ] && timeout ${WS_BENCH_S:-150} $CLIENT_PIN python3 bench/ws_bench.py --concurrency 1 2 4 8 --requests ${REQS:-30} \
  --json "$OUT/ws_bench.json"
kill $server; wait $server 2> /dev/null
# the port is free before the script ends, so a call may run it twice (an A/B of SERVER_ARGS, each with its own OUT);
# never `pkill -f "python3 -m app"` between them: it matches the call's own shell
for _ in $(seq 30); do curl -s localhost:8000/healthz > /dev/null || break; sleep 1; done
# a file over 16 MB does not come back (a storm's records): compressed, it does (bench/summarize.py reads .json.gz)
find "$OUT" -name "*.json" -size +12M -exec gzip -f {} \;
grep -v -E "GET /readyz|WebSocket /v1|connection (open|closed)| rid [0-9]+ done|gateway.requests" /tmp/server.log | tail -15
