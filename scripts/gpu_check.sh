#!/usr/bin/env bash
# What to run on one lent GPU in under 20 minutes (scripts/gpu_check.py says what each step checks).
#   bash scripts/gpu_check.sh [OUT.json]      # GPU: every GPU-marked test, 3 SSP steps of SmolLM2-135M
#                                             # under NCCL with the HF rollout engine, log-probs against
#                                             # the CPU reference, the HF export against DeepSpeed's
#   GPU_CHECK_ARGS="--tiny" bash scripts/gpu_check.sh out.json    # CPU: the same steps at tiny scale (CI)
# A lent GPU machine has torch, transformers and Triton but no DeepSpeed, vLLM or package index: Python
# packages travel as wheels in $WHEELS (default .gpu_carry/whl; build them with
# `bash scripts/gpu_check.sh --pack`), and the prepared data (tokenizer, corpus, proposer rows; not the
# 517 MB of weights) in $SSP_DATA_DIR (default .gpu_carry/data when it exists, else data/).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.gpu_carry}
if [ "${1:-}" = "--pack" ]; then
  # Run here (with pip and the prepared data/) before sending the tree to a GPU machine.
  rm -rf "$CARRY" && mkdir -p "$CARRY/whl" "$CARRY/data/models" "$CARRY/data/train" "$CARRY/data/corpus"
  PY=${PYTHON:-.venv/bin/python}
  # DeepSpeed as a pure-Python wheel (ops JIT-built on first use, none needed with torch AdamW), plus
  # what it needs and the machine lacks; bm25s for the in-process index. Python 3.12, x86-64.
  DS_VERSION=$($PY -c "from importlib.metadata import version; print(version('deepspeed'))")
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/whl" "deepspeed==$DS_VERSION" \
    || $PY -m pip download -q --no-deps -d "$CARRY/whl" "deepspeed==$DS_VERSION"
  # the versions this venv resolved together (pydantic pins its pydantic-core exactly)
  pins=$($PY -c "from importlib.metadata import version as v; print(' '.join(f'{n}=={v(n)}' for n in
    ('hjson', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection', 'typing-extensions', 'bm25s')))")
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/whl" $pins
  m=data/models/SmolLM2-135M-Instruct
  mkdir -p "$CARRY/$m" && cp $m/*.json $m/*.jinja "$CARRY/$m/" && touch "$CARRY/$m/.complete"
  cp data/corpus/wiki.jsonl "$CARRY/data/corpus/" && cp data/train/proposer.jsonl data/train/solver_qa.jsonl "$CARRY/data/train/"
  du -sh "$CARRY"
  exit 0
fi
OUT_JSON=${1:-gpu_check.json}
WHEELS=${WHEELS:-$CARRY/whl}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  [ -d "$WHEELS" ] || { echo "gpu_check: DeepSpeed is not installed and $WHEELS holds no wheels (bash scripts/gpu_check.sh --pack)" >&2; exit 1; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_check_site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${SSP_DATA_DIR:-}" ] && [ -d "$CARRY/data" ]; then export SSP_DATA_DIR=$PWD/$CARRY/data; fi
export SSP_DATA_DIR=${SSP_DATA_DIR:-$PWD/data}
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
# shellcheck disable=SC2086
exec "$PYTHON" scripts/gpu_check.py --out "$OUT_JSON" --data_dir "$SSP_DATA_DIR" ${GPU_CHECK_ARGS:-}
