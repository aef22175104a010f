#!/usr/bin/env bash
# Download the Python 3.12 x86-64 wheels that bench/gpu_suite.py needs and the GPU machine's image lacks
# (no torch, transformers or safetensors: the image has them) into the git-ignored .whl/, to be carried
# and installed offline there. Versions are the ones this checkout's venv runs, so the device runs a
# tested combination. Usage: bench/gpu_wheels.sh [DEST] (default .whl); README "Benchmarks" has the
# device command.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3

# peagle_core: pydantic and its parts (the image has none of them).
core="pydantic pydantic-core annotated-types typing-inspection typing-extensions"
# speculators' P-EAGLE for the side-by-side step, and what `import speculators` pulls in that the image
# lacks (its package imports its data pipeline: datasets, openai, hs-connectors).
side="speculators hs-connectors loguru pydantic-settings python-dotenv datasets dill multiprocess
      openai jiter sniffio httpx2 httpcore2 truststore"

pins=$("$py" - $core $side <<'EOF'
import importlib.metadata as md
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)  # not installed here: the newest release
EOF
)

rm -rf "$dest"
mkdir -p "$dest"
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" $pins
ls "$dest"
echo "total: $(du -sh "$dest" | cut -f1) in $(ls "$dest" | wc -l) wheels (carry limit 64 MiB with the tree)"
