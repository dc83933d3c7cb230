# Sourced by the bench/device_*.sh scripts on the GPU machine: $OUT, the carried wheels (.whl, see
# docs/benchmarks.md) installed into /tmp/site, and the paths that find them.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
