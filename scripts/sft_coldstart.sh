#!/usr/bin/env bash
# The SFT cold start of SmolLM2-135M-Instruct on multi-turn search demonstrations, shared by the
# CPU demo (scripts/demo_cpu.sh) and the CPU learning proof (scripts/learning_proof_cpu.sh), so
# both start self-play from a model made the same way:
#   1. the cold-start demos, data/train/coldstart.jsonl (python -m dataprep.coldstart; built once,
#      together with the held-out eval set data/eval/wiki_desc_heldout.jsonl), and their leak check
#      against every eval set, said out loud
#   2. training.loop.sft on the first SFT_DEMOS of them -> HF export at SFT_DIR/hf (train.py --model_path,
#      eval.py --model)
# The demos are built when missing, always (the eval sets need wiki_desc_heldout.jsonl). The SFT is
# skipped when SFT_DIR/hf already holds a finished export (config.json + model.safetensors or its
# sharded index): the export is written to a temporary folder and renamed, so a folder there is whole.
# A killed SFT run resumes from its last checkpoint (--save_every) on the next call.
#
#   bash scripts/sft_coldstart.sh runs/demo_cpu/sft
#   SFT_DEMOS=64 SFT_BATCH=16 bash scripts/sft_coldstart.sh /tmp/sft
#
# The demos fit the rollout protocol they are trained for (dataprep/protocol.py): SFT_MAX_TURNS (3),
# SFT_MAX_TOKENS_PER_TURN (64), SFT_MAX_INFO_TOKENS (160), SFT_MIN_SEARCHES (2) and SFT_MIN_QUESTION_WORDS (4)
# are the RL and eval flags of the same names (the ladder's and the demo's); the mix records the protocol
# it was built for (data/train/coldstart_mix.jsonl.protocol.json) and is rebuilt when they differ.
# Knobs (environment): SFT_DEMOS (960: the whole mix), SFT_BATCH (32 demos per optimizer step), SFT_LR (2e-4, cosine,
# 1 warm-up step), SFT_TOP_LAYERS (12 of SmolLM2's 30 trained), SFT_THREADS (torch threads, default: all cores), BASE_MODEL,
# COLDSTART (the demos file), DTYPE (bf16 or fp32; default: measured by python -m utils.cpu_dtype, bf16 only
# where its GEMMs are clearly faster: ~4x on AMX Xeons, no faster on AVX2-only EPYCs; docs/PLATFORM_NOTES.md, CPU dtype).
set -euo pipefail
cd "$(dirname "$0")/.."
SFT_DIR=${1:?usage: bash scripts/sft_coldstart.sh SFT_DIR   (the HF export lands in SFT_DIR/hf)}
SFT_DEMOS=${SFT_DEMOS:-960}
SFT_BATCH=${SFT_BATCH:-32}
SFT_LR=${SFT_LR:-2e-4}
SFT_TOP_LAYERS=${SFT_TOP_LAYERS:-12}
SFT_MAX_INFO_TOKENS=${SFT_MAX_INFO_TOKENS:-160}
SFT_MAX_TURNS=${SFT_MAX_TURNS:-3}
SFT_MAX_TOKENS_PER_TURN=${SFT_MAX_TOKENS_PER_TURN:-64}
SFT_MIN_SEARCHES=${SFT_MIN_SEARCHES:-2}
SFT_MIN_QUESTION_WORDS=${SFT_MIN_QUESTION_WORDS:-4}
PROTOCOL=(--max_turns "$SFT_MAX_TURNS" --max_tokens_per_turn "$SFT_MAX_TOKENS_PER_TURN" --max_info_tokens "$SFT_MAX_INFO_TOKENS"
          --min_searches "$SFT_MIN_SEARCHES" --min_question_words "$SFT_MIN_QUESTION_WORDS")
SFT_THREADS=${SFT_THREADS:-$(nproc)}
BASE_MODEL=${BASE_MODEL:-data/models/SmolLM2-135M-Instruct}
COLDSTART=${COLDSTART:-data/train/coldstart_mix.jsonl}
PY=${PY:-.venv/bin/python}
DTYPE=${DTYPE:-$(OMP_NUM_THREADS=$SFT_THREADS $PY -m utils.cpu_dtype --verbose --keep_in "$SFT_DIR")}   # kept in SFT_DIR/dtype: a resumed SFT stays in its dtype
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"

hf_export_done() {  # a finished HF export: config plus one safetensors file or the index of its shards
  [ -f "$1/config.json" ] && { [ -f "$1/model.safetensors" ] || [ -f "$1/model.safetensors.index.json" ]; }
}

t=$(date +%s)
[ -f data/indexes/bm25/manifest.json ] || $PY -m retrieval.build_index --corpus data/corpus/wiki.jsonl \
  --out data/indexes/bm25 --kind bm25
if [ -f data/train/coldstart.jsonl ] && [ -f data/eval/wiki_desc_heldout.jsonl ]; then
  echo "-- cold-start demos: reusing data/train/coldstart.jsonl"
else
  echo "-- cold-start demos: writing data/train/coldstart.jsonl (searches run against the BM25 index; once)"
  # its solver demos feed the mix (their last thought is rewritten to fit the protocol there); the mix's proposer
  # demos are the game's (dataprep/game_demos.py), so none are built here
  $PY -m dataprep.coldstart --out data/train/coldstart.jsonl --proposer_n 0 --max_turns "$SFT_MAX_TURNS" \
    --max_tokens_per_turn "$SFT_MAX_TOKENS_PER_TURN" --min_searches "$SFT_MIN_SEARCHES"
fi
# reading and two-hop rows, their held-out sets, and the demo mix (coldstart_mix.jsonl; ~30 s), rebuilt when it was
# built for another protocol
$PY -m dataprep.reading_sets "${PROTOCOL[@]}"
if hf_export_done "$SFT_DIR/hf"; then
  echo "-- SFT cold start: skipped, $SFT_DIR/hf already holds an HF export (delete $SFT_DIR to redo it)"
  exit 0
fi
$PY -m dataprep.coldstart --check "$COLDSTART"   # the leak check, said out loud

echo "-- SFT: $SFT_DEMOS demos, batch $SFT_BATCH, lr $SFT_LR, top $SFT_TOP_LAYERS layers, $DTYPE -> $SFT_DIR/hf" \
  "(log: $SFT_DIR.log)"
mkdir -p "$(dirname "$SFT_DIR")"
OMP_NUM_THREADS=$SFT_THREADS $PY -m training.loop.sft --model_path "$BASE_MODEL" --data "$COLDSTART" \
  --output_dir "$SFT_DIR" --dtype "$DTYPE" --batch_size "$SFT_BATCH" --max_demos "$SFT_DEMOS" --epochs 1 \
  --lr "$SFT_LR" --warmup_steps 1 --lr_schedule cosine --train_top_layers "$SFT_TOP_LAYERS" \
  --max_info_tokens "$SFT_MAX_INFO_TOKENS" --gradient_checkpointing false --seed 0 --save_every 4 \
  2>&1 | tee -a "$SFT_DIR.log"
hf_export_done "$SFT_DIR/hf" || { echo "sft_coldstart: training.loop.sft left no HF export in $SFT_DIR/hf" >&2; exit 1; }
echo "-- SFT cold start done in $(( $(date +%s) - t )) s: $SFT_DIR/hf"
