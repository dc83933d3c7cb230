#!/usr/bin/env bash
# Ray Serve in .venv-ray, layered over the gateway's .venv (scripts/setup makes that one): the gateway's
# packages are read from .venv, Ray and its newer protobuf from .venv-ray, which comes first on sys.path.
# Idempotent. Then:
#   .venv-ray/bin/python -m pytest tests/system/test_scaling.py -m ray        # the local Ray Serve tests
#   PYTHONPATH=$PWD .venv-ray/bin/serve run deploy/ray_serve_local.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/setup first (the gateway's .venv)" >&2; exit 1; }
PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
[ -x .venv-ray/bin/python ] || "$PY" -m venv .venv-ray
site=$(.venv-ray/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base" > "$site/zz-zonos-gateway-venv.pth"   # after .venv-ray's own packages
echo "$PWD" > "$site/zz-zonos-gateway-repo.pth"    # app, engine and deploy for every Ray worker
stamp=".venv-ray/.requirements-$(sha256sum deploy/requirements-ray.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "== installing Ray Serve into .venv-ray"
  .venv-ray/bin/python -m pip install --quiet -r deploy/requirements-ray.txt
  rm -f .venv-ray/.requirements-*
  touch "$stamp"
fi
.venv-ray/bin/python -c 'import ray, google.protobuf, app.server, deploy.ray_serve; print("ray", ray.__version__, "protobuf", google.protobuf.__version__)'
