# Sourced by the bench/device_*.sh scripts on the GPU machine: $OUT, the carried wheels (.whl, see
# docs/benchmarks.md) installed into /tmp/site, and the paths that find them.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
# every test with a CUDA path (the GPU test list): the captured graphs (default, invariant, overlap, emotion
# rows), kernels, twins, the DAC, the aligner at full size, a seed under load
GPU_TESTS="tests/gpu/test_gpu.py tests/gpu/test_aligner.py tests/engine/test_kernels.py tests/engine/test_dac_streaming.py \
tests/engine/test_prefill_attention.py tests/engine/test_fused_router.py tests/unit/test_sampling.py \
tests/engine/test_mixed_step.py \
tests/engine/test_guidance.py tests/engine/test_fp8.py tests/engine/test_batch_invariance.py \
tests/engine/test_continuation.py::test_gpu_a_reply_of_five_requests_is_one_stream"
SEED_TEST=tests/gpu/test_gpu.py::test_seeded_request_alone_and_beside_1_8_127_streams_same_codes_pcm_within_the_stated_snr
# a package the device lacks fails here in a second, not minutes later when the server starts (a missing wheel
# cost a capacity run its whole call once): carry it in .whl, e.g. `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION` (versions: .venv here)
python3 -c "import app.server, engine.runtime.entry, lameenc, av, samplerate" 2> /tmp/import.err \
  || { echo "the gateway does not import on this machine (carry the missing wheel in .whl):"; tail -1 /tmp/import.err; exit 2; }
