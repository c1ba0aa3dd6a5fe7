#!/usr/bin/env bash
# Here, in the repository: prepare what the GPU session carries besides the kit (gpu/run_session.md).
#   .whl/  turnkv's Python dependencies that neither the device image nor vLLM's wheels provide
#          (structlog, redis; checked against ../shared/device/wheels.txt and the image's package list),
#          and the vllm-turnkv plugin as a wheel. Ignored through .git/info/exclude.
#   .stage/kit  must exist (../shared/device/make_bundle.sh writes it with the chunks .stage/c0..c6).
# Re-run after changing plugins/vllm-turnkv. Needs pip with network access (PyPI) for the three wheels
# and for the plugin's build backend (setuptools, in pip's isolated build environment).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
py=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl

# turnkv's requirements (pyproject.toml) that the device lacks: the image has aiohttp, jinja2, pyyaml,
# prometheus-client, anyio; vLLM's wheels bring starlette, uvicorn, pydantic, pydantic-settings,
# python-dotenv, openai. structlog and redis are pure Python; orjson is compiled (a manylinux wheel for
# CPython 3.12).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  'structlog==26.1.0' 'redis==8.1.0' 'orjson==3.13.0'

# the plugin: a pure-Python wheel (installing a wheel on the device needs no build backend)
"$py" -m pip wheel -q --no-deps -w .whl plugins/vllm-turnkv
rm -rf plugins/vllm-turnkv/build plugins/vllm-turnkv/src/*.egg-info

ls -l .whl
if [ -d .stage/kit ]; then
  for m in model-1b-keep model-1b-strip model-8b-keep; do
    [ -f ".stage/kit/$m/tokenizer.json" ] || { echo "stage.sh: .stage/kit/$m is missing; run ../shared/device/make_bundle.sh" >&2; exit 1; }
  done
  echo "kit: $(du -sh .stage/kit | cut -f1), chunks: $(ls -d .stage/c[0-9]* 2>/dev/null | wc -l)"
else
  echo "stage.sh: no .stage/kit yet: run ../shared/device/make_bundle.sh (downloads ~400 MB), then this again" >&2
  exit 1
fi
echo "carry with the kit call: [\".stage/kit\", \".whl\"] ($(du -sh .whl | cut -f1)); see gpu/run_session.md"
