#!/usr/bin/env bash
# One call on the GPU machine for the GPU test list (GPU_TESTS, bench/device_env.sh), which must pass in any
# order: the list once in pytest-randomly's shuffled order (files and tests; RANDOMLY_SEED repeats an
# order), then the seed-under-load test alone with its printed SNRs (SEED_TEST). The pytest-randomly wheel
# travels in .whl (pip download --no-deps -d .whl pytest-randomly==5.1.0), as the other carried wheels.
# Usage (device tool): bash bench/device_gpu_tests.sh [shuffled] [seeds]   (default: both)
# PARALLEL=N deals the list's files round-robin to N pytest processes that share the GPU: on an H100 the list takes
# ~590 s in one process, more than a call's 600 s with the seed step; with PARALLEL=3 TESTS_S=400 it took 355 s
# (2026-12-05, fb05711: groups of 339 / 64 / 213 s, 300 passed, 1 skipped); PARALLEL=4 TESTS_S=330: 175 / 57 /
# 46 / 72 s (20ba327, H100, 300 passed, 1 skipped).
# Files under $OUT: gpu_tests_shuffled.log (gpu_tests_shuffled_<group>.log with PARALLEL), seed_test.log
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
steps=${*:-shuffled seeds}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
rc=0
for step in $steps; do
  case $step in
    shuffled)
      python3 -c "import pytest_randomly" || { echo "pytest-randomly is not installed: carry its wheel in .whl"; exit 2; }
      seed=${RANDOMLY_SEED:-$RANDOM}
      echo "GPU list shuffled: --randomly-seed=$seed"
      if [ "${PARALLEL:-1}" -gt 1 ]; then  # the files dealt round-robin to PARALLEL pytest processes at once
        files=($GPU_TESTS); pids=()
        for g in $(seq 0 $(( PARALLEL - 1 ))); do
          group=(); for i in "${!files[@]}"; do [ $(( i % PARALLEL )) = "$g" ] && group+=("${files[$i]}"); done
          timeout -s INT -k 20 ${TESTS_S:-420} python3 -m pytest -q -p no:cacheprovider -p randomly \
            --randomly-seed="$seed" "${group[@]}" > "$OUT/gpu_tests_shuffled_$g.log" 2>&1 & pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        for g in $(seq 0 $(( PARALLEL - 1 ))); do echo "== group $g"; tail -6 "$OUT/gpu_tests_shuffled_$g.log"; done
      else
        timeout -s INT -k 20 ${TESTS_S:-420} python3 -m pytest -q -p no:cacheprovider -p randomly \
          --randomly-seed="$seed" $GPU_TESTS > "$OUT/gpu_tests_shuffled.log" 2>&1 || rc=1
        tail -15 "$OUT/gpu_tests_shuffled.log"
      fi ;;
    seeds)
      timeout -s INT -k 20 ${SEED_S:-240} python3 -m pytest -q -rP -p no:cacheprovider $SEED_TEST \
        > "$OUT/seed_test.log" 2>&1 || rc=1
      grep -E "seeded request|passed|failed|skipped|Error" "$OUT/seed_test.log" | tail -12 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $rc
