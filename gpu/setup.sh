#!/usr/bin/env bash
# Once per GPU host (idempotent), from the repository root; gpu/session.sh runs it as its "setup" step.
# Everything goes under TURNKV_GPU_HOME (default /root as root, else ~/.turnkv-gpu), nothing into the
# system's Python:
#   1. vLLM: this python3's own (pip install 'vllm>=0.26'), checked to import with NIXL; on a host without a
#      package index, the offline bundle (gpu/offline/install.sh) into $TURNKV_GPU_HOME/site;
#   2. the model folders (gpu/make_model.py: Qwen3 shapes, dummy weights) into $TURNKV_GPU_HOME/kit, or the
#      offline kit's copy (.stage/kit);
#   3. the vllm-turnkv plugin into $TURNKV_GPU_HOME/plugin-site (on PYTHONPATH only for engines that want it);
#   4. turnkv's dependencies vLLM lacks into $TURNKV_GPU_HOME/turnkv-site, and an import check of the gateway;
#   5. the history-sensitive model $TURNKV_GPU_HOME/models/sharp (gpu/make_sharp_model.py, numpy only).
# gpu/devlib.py finds each where this put it (the same defaults and TURNKV_* variables).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
home="${TURNKV_GPU_HOME:-$([ "$(id -u)" = 0 ] && echo /root || echo "$HOME/.turnkv-gpu")}"
kit="${TURNKV_KIT:-$home/kit}"
plugin="${TURNKV_PLUGIN_SITE:-$home/plugin-site}"
gw="${TURNKV_GATEWAY_SITE:-$home/turnkv-site}"
mkdir -p "$home"

# 1. vLLM
offline=""
if [ -n "${TURNKV_VLLM_SITE:-}" ]; then
  site="$TURNKV_VLLM_SITE"
elif [ -f "$home/site/.done" ] || ls .stage/c*/part.* "$home"/chunks/part.* >/dev/null 2>&1; then
  TURNKV_GPU_HOME="$home" bash gpu/offline/install.sh
  site="$home/site" offline=1
else
  site=""
fi
PYTHONPATH="$site" python3 -c "
import vllm, nixl._api
major, minor = (int(x) for x in vllm.__version__.split('.')[:2])
assert (major, minor) >= (0, 26), f'vLLM {vllm.__version__}: turnkv needs >= 0.26 (bidirectional_kv_xfer)'
print('vllm', vllm.__version__, 'nixl ok')" || {
  echo "setup: no vLLM >= 0.26 with NIXL for $(command -v python3): pip install 'vllm>=0.26' (and nixl), or" \
    "stage the offline bundle (gpu/README.md)" >&2
  exit 1
}

# 2. the model folders
if [ -d .stage/kit ]; then
  rm -rf "$kit" && mkdir -p "$(dirname "$kit")" && cp -r .stage/kit "$kit"
fi
for size in 8b 1b; do for t in keep strip; do
  [ -f "$kit/model-$size-$t/tokenizer.json" ] ||
    PYTHONPATH="$site" python3 gpu/make_model.py "$kit/model-$size-$t" --size "$size" --template "$t"
done; done

# 3-4. the plugin and turnkv's dependencies: the staged wheels, else from the package index
pipi() { python3 -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
if ls .whl/vllm_turnkv-*.whl >/dev/null 2>&1; then
  pipi "$plugin" --no-index .whl/vllm_turnkv-*.whl
  # shellcheck disable=SC2046  # one argument per wheel
  pipi "$gw" --no-index $(ls .whl/*.whl | grep -v vllm_turnkv)
elif [ -n "$offline" ] && [ ! -d "$plugin/vllm_turnkv" ]; then
  echo "setup: no .whl/: make it where there is a package index (gpu/offline/stage.sh) and copy it here" >&2
  exit 1
elif [ -z "$offline" ]; then
  pipi "$plugin" ./plugins/vllm-turnkv
  rm -rf plugins/vllm-turnkv/build plugins/vllm-turnkv/src/*.egg-info
  PYTHONPATH="src:$gw:$site" python3 -c "import structlog, redis, orjson" 2>/dev/null || pipi "$gw" structlog redis orjson
fi
PYTHONPATH="$plugin" python3 -c "
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group='vllm.general_plugins')]
assert 'vllm_turnkv:register' in eps, eps
print('plugin entry point:', eps)"
PYTHONPATH="src:$gw${site:+:$site}" python3 -c "
import turnkv.gateway.app, turnkv.cli, structlog, redis, aiohttp, pydantic_settings
print('gateway imports ok')"

# 5. the history-sensitive model
[ -f "$home/models/sharp/model.safetensors" ] ||
  python3 gpu/make_sharp_model.py "$home/models/sharp" --tokenizer-from "$kit/model-1b-keep"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "setup: done in $(( $(date +%s) - t0 )) s"
