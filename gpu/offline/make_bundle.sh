#!/usr/bin/env bash
# Here, on a machine with a package index, from the repository root: everything a GPU host without one
# needs to run gpu/, in .stage/ (ignored through .git/info/exclude). Copy .stage/ to the GPU host's
# repository root, then run gpu/setup.sh there (gpu/README.md, "A host without a package index").
#   .stage/c0 .. .stage/cN   vLLM 0.26.0, NIXL and their dependencies: the wheels of gpu/offline/wheels.txt
#                            (about 400 MB; CPython 3.12, x86_64, for a host that has torch 2.11), packed into
#                            chunks of TURNKV_CHUNK_MB (60) MiB each, for transports that limit a transfer
#   .stage/kit               the model folders (gpu/make_model.py) and gpu/offline/install.sh
#   .whl/                    turnkv's dependencies vLLM lacks and the vllm-turnkv plugin (gpu/offline/stage.sh)
# Needs python3 with pip; tokenizers is installed for gpu/make_model.py where missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
grep -qxF '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
cache="${TURNKV_WHEEL_CACHE:-$HOME/.cache/turnkv-gpu-wheels}"
mkdir -p "$cache" .stage
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform any \
  -d "$cache" -r "$here/wheels.txt"
rm -rf .stage/c[0-9]* .stage/kit
tar -C "$cache" -cf .stage/bundle.tar .
split -b "${TURNKV_CHUNK_MB:-60}M" -d -a 1 .stage/bundle.tar .stage/part.
rm .stage/bundle.tar
n=0
for f in .stage/part.*; do mkdir -p ".stage/c$n"; mv "$f" ".stage/c$n/"; n=$((n+1)); done
mkdir -p .stage/kit
cp "$here/install.sh" .stage/kit/
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q tokenizers
for size in 8b 1b; do for t in keep strip; do
  python3 gpu/make_model.py ".stage/kit/model-$size-$t" --size "$size" --template "$t"
done; done
bash "$here/stage.sh"
echo "chunks: $n (.stage/c0 .. .stage/c$((n-1))); kit: .stage/kit ($(du -sh .stage/kit | cut -f1)); .whl: $(ls .whl | wc -l) wheels"
