#!/usr/bin/env bash
# Start the retrieval server (Search-R1's POST /retrieve API) in the foreground.
#
#   bash scripts/start_retriever.sh                              # dense MiniLM index, 127.0.0.1:8000
#   INDEX=data/indexes/bm25 PORT=8001 bash scripts/start_retriever.sh
#   INDEX=/idx/e5_flat DEVICE=cuda EXTRA="--faiss-gpu" bash scripts/start_retriever.sh
#   # Search-R1's prebuilt e5_Flat.index + wiki-18.jsonl, made into a folder once with
#   #   python -m retrieval.import_searchr1 --index e5_Flat.index --corpus wiki-18.jsonl --encoder /models/e5-base-v2 --out /idx/e5_wiki18
#   # then served with its shards on GPUs 6 and 7 only (float16: 16.1 GB each), the query encoder on GPU 7:
#   INDEX=/idx/e5_wiki18 DEVICE=cuda:7 FAISS_GPUS=6,7 EXTRA="--faiss-fp16" bash scripts/start_retriever.sh
#
# Multi-node training: start ONE retriever per node (this script, on every node) and point that
# node's trainer ranks at http://localhost:$PORT (train.py --retriever_url). Each node then serves its own
# ranks, batching their queries together, and no search traffic crosses the network.
#
# Variables: INDEX (index folder, default data/indexes/minilm_flat), HOST (default 127.0.0.1;
# 0.0.0.0 exposes it to the network), PORT (8000), DEVICE (cpu|cuda|cuda:N, the query encoder), THREADS (CPU
# threads), FAISS_GPUS (GPU ids for the FAISS index shards, e.g. "0,1"; default: the index stays on the CPU
# unless EXTRA has --faiss-gpu, which takes every visible GPU; ids count after CUDA_VISIBLE_DEVICES),
# EXTRA (more flags for `python -m retrieval.server`, e.g. "--max-batch 128 --encoder /models/e5").
# The server opens its port at once and answers /health 503 while the index loads; clients wait.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

INDEX=${INDEX:-data/indexes/minilm_flat}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cpu}
EXTRA=${EXTRA:-}
if [ ! -f "$INDEX/manifest.json" ]; then
  echo "start_retriever.sh: no finished index in $INDEX; build it with \`bash scripts/build_index.sh\`, or make one" \
       "for Search-R1's e5_Flat.index with \`$PY -m retrieval.import_searchr1 --index FILE --corpus JSONL --encoder DIR --out DIR\`" >&2
  exit 2
fi
threads=()
[ -n "${THREADS:-}" ] && threads=(--threads "$THREADS")
gpus=()
[ -n "${FAISS_GPUS:-}" ] && gpus=(--faiss-gpus "$FAISS_GPUS")
# shellcheck disable=SC2086  # EXTRA is a list of flags
exec "$PY" -m retrieval.server --index "$INDEX" --host "$HOST" --port "$PORT" --device "$DEVICE" "${threads[@]}" "${gpus[@]}" $EXTRA
