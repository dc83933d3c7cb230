#!/usr/bin/env bash
# One call on the GPU machine for the kernels of this build: the GPU tests (beside the seed-invariance run:
# both check results, not speed), then, with the GPU to themselves, FP8 experts against bf16
# (bench/fp8_fidelity.py), the DAC's variants if DAC_S is set (bench/dac_step.py) and the decode step (bench/decode_step.py,
# DECODE_ARGS: --ab for the batch-invariance cost, --overlap-host-ms MS for overlapped steps).
# Files under $OUT: run.log, gpu_tests.log, seed_invariance[_continuation,_cfg].json/.log, fp8_fidelity.json/.log,
# fp8_sweep.json/.log (FP8_SWEEP),
# dac_step.json/.log, decode_ab.json/.log (all but run.log packed into results.tgz)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
timeout -s INT -k 20 ${TESTS_S:-420} python3 -m pytest -q -p no:cacheprovider ${TESTS:-$GPU_TESTS} \
  > "$OUT/gpu_tests.log" 2>&1 &
tests=$!
timeout ${SEED_S:-200} python3 bench/seed_invariance.py --json "$OUT/seed_invariance.json" > "$OUT/seed_invariance.log" 2>&1
tail -25 "$OUT/seed_invariance.log"
# the continuation and guidance paths: a reply's second sentence, a speaker-CFG request with its twin
for target in ${SEED_TARGETS:-continuation cfg}; do
  timeout ${SEED_S:-200} python3 bench/seed_invariance.py --target $target --batches 8 128 --frames 60 \
    --json "$OUT/seed_invariance_$target.json" > "$OUT/seed_invariance_$target.log" 2>&1
  grep -v "^  ops" "$OUT/seed_invariance_$target.log" | tail -8
done
wait $tests; tail -8 "$OUT/gpu_tests.log"
# FP8 experts against bf16 on the full-size model: fidelity figures and decode step times
[ -n "${FP8_S-150}" ] && { timeout ${FP8_S:-150} python3 bench/fp8_fidelity.py --prompts ${FP8_PROMPTS:-4} \
  --frames ${FP8_FRAMES:-100} --batches ${FP8_BATCHES:-64 128} --json "$OUT/fp8_fidelity.json" \
  > "$OUT/fp8_fidelity.log" 2>&1; grep -v "^\s*$" "$OUT/fp8_fidelity.log" | tail -24; }
# FP8_SWEEP="64 128 192": one full-size MoE layer's tile variants per batch (blocked, prequant, swap_ab)
[ -n "${FP8_SWEEP:-}" ] && { timeout ${FP8_SWEEP_S:-300} python3 bench/fp8_fidelity.py --sweep --batches $FP8_SWEEP \
  --json "$OUT/fp8_sweep.json" > "$OUT/fp8_sweep.log" 2>&1; grep -E "^batch|Error" "$OUT/fp8_sweep.log" | head -40; }
[ -n "${DAC_S-}" ] && { timeout ${DAC_S} python3 bench/dac_step.py --json "$OUT/dac_step.json" --profile \
  > "$OUT/dac_step.log" 2>&1; grep -v "^\s*$" "$OUT/dac_step.log" | head -30; }
# the decode step: sequential vs overlapped (--overlap-decode) with the host work the engine measured per step
[ -n "${DECODE_S-150}" ] && { timeout ${DECODE_S:-150} python3 bench/decode_step.py --batches ${BATCHES:-1 64 128} \
  ${DECODE_ARGS:---ab} --json "$OUT/decode_ab.json" > "$OUT/decode_ab.log" 2>&1
  grep -v "^\s*$" "$OUT/decode_ab.log" | tail -20; }
# at most 8 files come back from $OUT: every result in one archive, beside this run's log
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude run.log ./* \
  && find . -maxdepth 1 -type f ! -name results.tgz ! -name run.log -delete)
