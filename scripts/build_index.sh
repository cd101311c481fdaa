#!/usr/bin/env bash
# Build the demo retrieval indexes over data/corpus/wiki.jsonl (10,033 Wikipedia lead extracts):
#   BM25 (bm25s)                   -> data/indexes/bm25         (~10 s)
#   dense all-MiniLM-L6-v2 + Flat  -> data/indexes/minilm_flat  (~3 min on 2 CPU cores)
# Re-running skips finished indexes; a killed dense build resumes from its last finished shard.
#
# Variables (override on the command line, e.g. `INDEX=hnsw DEVICE=cuda bash scripts/build_index.sh`):
#   CORPUS   corpus JSONL/parquet               (default data/corpus/wiki.jsonl)
#   OUT      folder holding both indexes         (default data/indexes)
#   ENCODER  dense encoder folder                (default: the bundled all-MiniLM-L6-v2)
#   INDEX    flat | hnsw | ivfpq                 (default flat)
#   NAME     dense index folder under OUT        (default minilm_$INDEX)
#   DEVICE   cpu | cuda                          (default cpu)
#   KINDS    which to build: "bm25 dense"        (default both)
#   EXTRA    extra flags for the dense build, e.g. "--fp16 --batch-size 512"
#   OVERWRITE=1 rebuilds finished indexes
#
# wiki-18 (21,015,324 passages) with e5-base-v2 on one GPU, as Search-R1 builds it (e5's "passage: "/"query: "
# prefixes come from the folder name; 256 tokens; fp16 stores the flat index in 32.3 GB instead of 64.6 GB;
# encoding time and RAM are estimated in docs/retrieval.md):
#   CORPUS=/data/wiki-18.jsonl OUT=/idx ENCODER=/models/e5-base-v2 NAME=e5_flat KINDS=dense DEVICE=cuda \
#     EXTRA="--fp16 --batch-size 512 --max-length 256 --shard-size 100000" bash scripts/build_index.sh
# Search-R1's prebuilt e5_Flat.index needs no build: `python -m retrieval.import_searchr1` (see docs/retrieval.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

CORPUS=${CORPUS:-data/corpus/wiki.jsonl}
OUT=${OUT:-data/indexes}
INDEX=${INDEX:-flat}
DEVICE=${DEVICE:-cpu}
KINDS=${KINDS:-"bm25 dense"}
EXTRA=${EXTRA:-}
ENCODER=${ENCODER:-$("$PY" -c 'from utils.assets import minilm_dir; print(minilm_dir())')}
NAME=${NAME:-minilm_$INDEX}

if [ ! -f "$CORPUS" ]; then
  echo "build_index.sh: $CORPUS not found; run \`$PY scripts/prepare_data.py\` first" >&2
  exit 2
fi

build() {  # build NAME ARGS...: skip a finished index unless OVERWRITE=1
  local dir="$OUT/$1"; shift
  if [ -f "$dir/manifest.json" ] && [ "${OVERWRITE:-0}" != 1 ]; then
    echo "build_index.sh: $dir is already built (OVERWRITE=1 rebuilds it)"
    return
  fi
  local ow=()
  [ "${OVERWRITE:-0}" = 1 ] && ow=(--overwrite)
  "$PY" -m retrieval.build_index --corpus "$CORPUS" --out "$dir" "${ow[@]}" "$@"
}

for kind in $KINDS; do
  case "$kind" in
    bm25)  build bm25 --kind bm25 ;;
    dense) # shellcheck disable=SC2086  # EXTRA is a list of flags
           build "$NAME" --kind dense --encoder "$ENCODER" --index "$INDEX" --device "$DEVICE" $EXTRA ;;
    *) echo "build_index.sh: unknown kind '$kind' in KINDS (use bm25 and/or dense)" >&2; exit 2 ;;
  esac
done
