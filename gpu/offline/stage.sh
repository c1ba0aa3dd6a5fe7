#!/usr/bin/env bash
# Here, on a machine with a package index, in the repository: .whl/, the wheels gpu/setup.sh installs on a GPU
# host without one (gpu/offline/make_bundle.sh runs this too):
#   turnkv's Python dependencies that vLLM's wheels do not bring (structlog, redis, orjson), and the
#   vllm-turnkv plugin as a wheel. Ignored through .git/info/exclude.
# Re-run after changing plugins/vllm-turnkv. Needs pip with network access for the three wheels and for the
# plugin's build backend (setuptools, in pip's isolated build environment).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
py=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl

# turnkv's requirements (pyproject.toml) that neither the bundle's wheels (starlette, uvicorn, pydantic,
# pydantic-settings, python-dotenv, openai) nor the GPU host's image it was made for (aiohttp, jinja2, pyyaml,
# prometheus-client, anyio, with torch 2.11) bring. structlog and redis are pure Python; orjson is compiled
# (a manylinux wheel for CPython 3.12).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  'structlog==26.1.0' 'redis==8.1.0' 'orjson==3.13.0'

# the plugin: a pure-Python wheel (installing a wheel on the device needs no build backend)
"$py" -m pip wheel -q --no-deps -w .whl plugins/vllm-turnkv
rm -rf plugins/vllm-turnkv/build plugins/vllm-turnkv/src/*.egg-info

ls -l .whl
