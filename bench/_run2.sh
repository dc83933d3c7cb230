set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
timeout 280 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py tests/test_prefill_attention.py tests/test_fused_router.py > $OUT/gpu_tests.log 2>&1; tail -25 $OUT/gpu_tests.log
timeout 240 python3 bench/decode_step.py --batches 1 2 4 8 16 32 64 --profile --json $OUT/decode.json > $OUT/decode_profile.log 2>&1; grep -B1 -A9 "^batch" $OUT/decode_profile.log; grep "graph replay" $OUT/decode_profile.log
timeout 200 python3 bench/prefill_step.py --prompts 1 2 4 --profile > $OUT/prefill.log 2>&1; grep "prefill" $OUT/prefill.log | head; tail -3 $OUT/prefill.log
