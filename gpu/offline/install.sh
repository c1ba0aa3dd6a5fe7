#!/usr/bin/env bash
# On a GPU host without a package index: install vLLM 0.26.0 + NIXL from the bundle gpu/offline/make_bundle.sh
# wrote, into $TURNKV_GPU_HOME/site (default /root/site as root, else ~/.turnkv-gpu/site), once. gpu/setup.sh
# runs it when the chunks are there: .stage/c*/part.* in the repository, or $TURNKV_GPU_HOME/chunks/part.*
# (where a transport that limits each transfer left them one by one). gpu/devlib.py then runs vLLM from
# that folder (PYTHONPATH); nothing is installed into the system's Python.
set -euo pipefail
home="${TURNKV_GPU_HOME:-$([ "$(id -u)" = 0 ] && echo /root || echo "$HOME/.turnkv-gpu")}"
site="$home/site"
if [ ! -f "$site/.done" ]; then
  # both places together (a transport may leave some parts in the repository and the rest in chunks/), each
  # part once, in the order of their names (part.0, part.1, ..., or part.0a, part.0b, ...)
  parts=$(for p in .stage/c*/part.* "$home"/chunks/part.*; do if [ -f "$p" ]; then echo "$(basename "$p") $p"; fi; done |
    sort -u -k1,1 | cut -d' ' -f2)
  [ -n "$parts" ] || { echo "install.sh: no bundle: .stage/c*/part.* or $home/chunks/part.*" >&2; exit 1; }
  work="$(mktemp -d)"
  echo "$parts" | xargs cat | tar -x -C "$work"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$work"/*.whl 2>&1 | tail -3
  rm -rf "$work"
  touch "$site/.done"
fi
PYTHONPATH="$site" python3 -c "import vllm, nixl._api; print('vllm', vllm.__version__, 'nixl ok')"
