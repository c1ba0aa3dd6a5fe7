#!/usr/bin/env bash
# On the device, once per machine (idempotent), from the repository root, in the call that carries
# [".stage/kit", ".whl"] after the chunk uploads (gpu/run_session.md):
#   1. vLLM 0.26.0 + NIXL into /root/site (the kit's install.sh, from /root/chunks);
#   2. the kit copied to /root/kit, so later calls need carry nothing;
#   3. the vllm-turnkv plugin wheel into /root/plugin-site (on PYTHONPATH only for engines that want it);
#   4. turnkv's extra dependencies (structlog, redis) into /root/turnkv-site, and an import check of
#      the gateway with PYTHONPATH=src:/root/turnkv-site:/root/site;
#   5. the history-sensitive model /root/models/sharp (gpu/make_sharp_model.py, numpy only).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
if [ -d .stage/kit ]; then rm -rf /root/kit && cp -r .stage/kit /root/kit; fi
[ -d /root/kit ] || { echo "device_setup: no kit: carry .stage/kit in this call" >&2; exit 1; }
bash /root/kit/install.sh
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
if ls .whl/vllm_turnkv-*.whl >/dev/null 2>&1; then
  pipi /root/plugin-site .whl/vllm_turnkv-*.whl
  pipi /root/turnkv-site $(ls .whl/*.whl | grep -v vllm_turnkv)
elif [ ! -d /root/plugin-site/vllm_turnkv ]; then
  echo "device_setup: no .whl/: carry .whl (gpu/stage.sh writes it)" >&2; exit 1
fi
PYTHONPATH=/root/plugin-site python3 -c "
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group='vllm.general_plugins')]
assert 'vllm_turnkv:register' in eps, eps
print('plugin entry point:', eps)"
PYTHONPATH=src:/root/turnkv-site:/root/site python3 -c "
import turnkv.gateway.app, turnkv.cli, structlog, redis, aiohttp, pydantic_settings
print('gateway imports ok')"
[ -f /root/models/sharp/model.safetensors ] || \
  python3 gpu/make_sharp_model.py /root/models/sharp --tokenizer-from /root/kit/model-1b-keep
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "device_setup: done in $(( $(date +%s) - t0 )) s"
