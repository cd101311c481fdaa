#!/usr/bin/env bash
# Train on your own data on CPU: SSP self-play from the demo's SFT export, with the recipe that plays
# (scripts/recipe.sh: the demo's and the learning proof's game), searching your corpus, then eval.py on your eval
# sets. The format of each file, its required and optional fields and an example: docs/data.md.
#
#   TRAIN_DATA=mine/answers.jsonl CORPUS=mine/corpus.jsonl bash scripts/own_data_cpu.sh
#   TRAIN_DATA=mine/answers.jsonl CORPUS=mine/corpus.jsonl QA_DATA=mine/qa.jsonl \
#     EVAL_DATA="mine/dev.jsonl mine/test.jsonl" OUT=runs/mine STEPS=20 bash scripts/own_data_cpu.sh
#   DRY_RUN=1 TRAIN_DATA=... CORPUS=... bash scripts/own_data_cpu.sh   # check the files, print the commands, run nothing
#   TRAIN_DATA=... CORPUS=... bash scripts/own_data_cpu.sh --solver_n 8  # extra arguments go to train.py (last wins)
#
# Your files (environment):
#   TRAIN_DATA  proposer answer rows {"answer", "search_turns"}, required: what the proposer writes questions for.
#               The answers should be findable in the corpus: the RAG check refuses a question its documents cannot
#               answer. search_turns is clamped to 1-2 (the CPU protocol allows 2 searches).
#   CORPUS      the documents {"id", "contents": "Title\ntext"} the search tool returns, required unless INDEX is
#               given: indexed once (BM25, scripts/build_index.sh) into $OUT/index/bm25, kept for re-runs
#   INDEX       an index folder you built already (scripts/build_index.sh, retrieval.import_searchr1), instead
#   QA_DATA     labelled QA rows {"question", "golden_answers", "data_source"}, optional: they seed the question
#               pool (--pool_init), so the solver trains from step 1 while the proposer learns to write valid questions
#   EVAL_DATA   eval sets in the QA rows' format, optional, space- or comma-separated: eval.py (greedy) on the SFT
#               start and on the trained model, a table per data_source, in $OUT/eval_sft and $OUT/eval
# Knobs: SFT_DIR (runs/demo_cpu/sft: the demo's SFT export, made by scripts/sft_coldstart.sh when missing), OUT
#   (runs/own_data), STEPS (6), PROMPTS (8 proposer prompts a step, 4 solver samples each), LR (2e-5), SEED (1),
#   RANKS (2 training processes over gloo), NPROC (cores: all), DTYPE (measured: python -m utils.cpu_dtype),
#   EVAL_LIMIT (rows per eval file; all), EVAL_SFT (1: also evaluate the start), OVERWRITE (true: train.py starts over
#   in an OUT whose recipe differs), REPORT_TO (tensorboard), PY (.venv/bin/python, installed by scripts/setup_cpu.sh),
#   and the game's own (scripts/recipe.sh: RAG_VERIFY, PROPOSER_REWARD, FORMAT_PENALTY, POOL_SOLVE, MIN_SEARCHES, ...).
#
# Why the demo's SFT export: zero-shot SmolLM2-135M ignores the search format, so every proposer question is
# invalid and the solver never answers, and RL has nothing to learn from (README, Quick start on CPU). The cold
# start teaches the format (its demos search the demo's Wikipedia corpus); your run then plays on your corpus.
#   1. your files read whole by the readers that will read them (python -m dataprep.check_inputs): a bad row
#      is named by file, line and field, before anything is built. DRY_RUN=1 stops after printing the rest.
#   2. the SFT export (reused when SFT_DIR/hf holds one)   3. the BM25 index of CORPUS (reused when built)
#   4. self-play: train.py on RANKS processes, checkpoints every step; a re-run resumes from the latest one
#   5. eval.py on EVAL_DATA
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=${DRY_RUN:-0}
TRAIN_DATA=${TRAIN_DATA:-}
CORPUS=${CORPUS:-}
INDEX=${INDEX:-}
QA_DATA=${QA_DATA:-}
EVAL_DATA=${EVAL_DATA:-}
OUT=${OUT:-runs/own_data}
SFT_DIR=${SFT_DIR:-runs/demo_cpu/sft}
STEPS=${STEPS:-6}
SEED=${SEED:-1}
RANKS=${RANKS:-2}
NPROC=${NPROC:-$(nproc)}
EVAL_LIMIT=${EVAL_LIMIT:-}
EVAL_SFT=${EVAL_SFT:-1}
OVERWRITE=${OVERWRITE:-false}
REPORT_TO=${REPORT_TO:-tensorboard}
source scripts/recipe.sh   # GAME, GAME_CPU, RL_CPU (PROMPTS, LR), EVAL_CPU, game_table

die() { echo "own_data_cpu.sh: $*" >&2; exit 2; }
[ -n "$TRAIN_DATA" ] || die "set TRAIN_DATA to your proposer answer rows ({\"answer\", \"search_turns\"} a line;" \
  "docs/data.md), e.g. TRAIN_DATA=mine/answers.jsonl CORPUS=mine/corpus.jsonl bash scripts/own_data_cpu.sh"
[ -n "$CORPUS" ] || [ -n "$INDEX" ] || die "set CORPUS to your documents ({\"id\", \"contents\": \"Title\\ntext\"} a line;" \
  "docs/data.md), or INDEX to an index folder built from them"
read -r -a EVAL_FILES <<< "${EVAL_DATA//,/ }"
given=("TRAIN_DATA=$TRAIN_DATA" "CORPUS=$CORPUS" "QA_DATA=$QA_DATA")
for f in "${EVAL_FILES[@]}"; do given+=("EVAL_DATA=$f"); done
for pair in "${given[@]}"; do
  f=${pair#*=}
  [ -z "$f" ] || [ -f "$f" ] || die "${pair%%=*}: $f: no such file"
done
[ -z "$INDEX" ] || [ -d "$INDEX" ] || die "INDEX: $INDEX: no such folder (build one with scripts/build_index.sh, or give CORPUS)"
[ -n "$INDEX" ] || INDEX=$OUT/index/bm25
for n in STEPS RANKS NPROC; do [[ ${!n} =~ ^[1-9][0-9]*$ ]] || die "$n must be a whole number >= 1 (got '${!n}')"; done

if [ -z "${PY:-}" ]; then   # the project's virtualenv (scripts/setup_cpu.sh: ~1 s once installed)
  PY=.venv/bin/python
  [ "$DRY" = 1 ] || bash scripts/setup_cpu.sh
fi
[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no python at $PY: run bash scripts/setup_cpu.sh first"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} DS_ACCELERATOR=cpu
export TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"

show() { printf '+'; printf ' %q' "$@"; echo; }     # a command as it would run, one line, shell-quoted
run() { show "$@"; [ "$DRY" = 1 ] || "$@"; }          # ... and run it, unless DRY_RUN=1
hf_export_done() {  # config plus one safetensors file or the index of its shards
  [ -f "$1/config.json" ] && { [ -f "$1/model.safetensors" ] || [ -f "$1/model.safetensors.index.json" ]; }
}

echo "== [1/5] your files (docs/data.md)"
check=("$PY" -m dataprep.check_inputs --train_data "$TRAIN_DATA" --index "$INDEX" --model "$SFT_DIR/hf")
[ -z "$CORPUS" ] || check+=(--corpus "$CORPUS")
[ -z "$QA_DATA" ] || check+=(--qa_data "$QA_DATA")
[ ${#EVAL_FILES[@]} = 0 ] || check+=(--eval_data "${EVAL_FILES[@]}")
"${check[@]}" || die "fix the file(s) named above; each format, with an example: docs/data.md"
[ -n "$QA_DATA" ] || echo "  (no QA_DATA: the solver trains only on questions the proposer gets through the RAG check)"
[ ${#EVAL_FILES[@]} -gt 0 ] || echo "  (no EVAL_DATA: no eval after training; give your eval sets to see the model's EM)"

echo "== [2/5] the SFT cold start to start from: $SFT_DIR/hf"
if hf_export_done "$SFT_DIR/hf"; then
  echo "  reused: $SFT_DIR/hf holds an HF export"
else
  echo "  $SFT_DIR/hf holds no HF export yet: the demo's cold start makes it (scripts/sft_coldstart.sh; ~6-30 min on 2 cores)"
  run "$PY" scripts/prepare_data.py
  run env PY="$PY" SFT_THREADS="$NPROC" ${DTYPE:+DTYPE="$DTYPE"} bash scripts/sft_coldstart.sh "$SFT_DIR"
fi
if [ "$DRY" = 1 ] && [ -z "${DTYPE:-}" ]; then
  DTYPE=MEASURED; echo "  (DTYPE: measured on this machine when it runs, python -m utils.cpu_dtype; shown as MEASURED)"
fi
export DTYPE=${DTYPE:-$(OMP_NUM_THREADS=$NPROC $PY -m utils.cpu_dtype --verbose --keep_in "$OUT")}   # SFT, RL and eval alike; kept in $OUT/dtype for reruns
EVAL_DTYPE=$(case "$DTYPE" in bf16) echo bfloat16 ;; fp32) echo float32 ;; *) echo "$DTYPE" ;; esac)

echo "== [3/5] the index your runs search: $INDEX"
if [ -f "$INDEX/manifest.json" ]; then
  echo "  reused: $INDEX is built${CORPUS:+ (from $CORPUS)}"
else
  run env CORPUS="$CORPUS" OUT="$(dirname "$INDEX")" KINDS=bm25 bash scripts/build_index.sh
fi

TRAIN=(train.py --model_path "$SFT_DIR/hf" --dtype "$DTYPE" "${RL_CPU[@]}" "${GAME[@]}" "${GAME_CPU[@]}"
  --index "$INDEX" --train_data "$TRAIN_DATA")
[ -z "$QA_DATA" ] || TRAIN+=(--pool_init "$QA_DATA")
TRAIN+=(--seed "$SEED" --total_steps "$STEPS" --save_every 1 --max_ckpts 2 --sample_every 1 --overwrite "$OVERWRITE"
  --output_dir "$OUT" --report_to "$REPORT_TO" "$@")
at=0
[ -f "$OUT/checkpoints/latest" ] && { s=$(cat "$OUT/checkpoints/latest"); at=$((10#${s#step_})); }
echo "== [4/5] self-play on your answers: $STEPS steps of $PROMPTS proposer prompts x 4 solver samples, $RANKS ranks -> $OUT"
if [ "$at" -ge "$STEPS" ] && [ "$OVERWRITE" != true ]; then
  echo "  skipped: the run in $OUT is at step $at already (a larger STEPS trains on)"
else
  [ "$at" = 0 ] || echo "  resumes from its checkpoint at step $at"
  [ "$DRY" = 1 ] || mkdir -p "$OUT"
  cmd=(env OMP_NUM_THREADS=$(( NPROC / RANKS > 0 ? NPROC / RANKS : 1 )) "$PY" -m torch.distributed.run --standalone
       --nproc_per_node "$RANKS" "${TRAIN[@]}")
  show "${cmd[@]}"
  [ "$DRY" = 1 ] || "${cmd[@]}" 2>&1 | tee -a "$OUT/train.log"
fi
if [ "$DRY" != 1 ]; then
  echo "   the games, per step ($OUT/metrics.jsonl; full text of some in $OUT/samples/):"
  game_table "$OUT/metrics.jsonl"
fi

if [ ${#EVAL_FILES[@]} = 0 ]; then
  echo "== [5/5] no EVAL_DATA, no eval: EVAL_DATA=\"dev.jsonl test.jsonl\" and a re-run of this line evaluates (training is kept)"
  [ "$DRY" != 1 ] || echo "own_data_cpu.sh: dry run: ok"
  exit 0
fi
if [ "$DRY" = 1 ]; then
  CKPT="$OUT/checkpoints/step_$(printf %06d "$STEPS")/hf"
else
  CKPT="$OUT/checkpoints/$(cat "$OUT/checkpoints/latest")/hf"
  hf_export_done "$CKPT" || die "$CKPT holds no HF export"
fi
evaluate() {  # model out_dir: eval.py (greedy), searching the same index with the same protocol as training
  local e=(env OMP_NUM_THREADS="$NPROC" "$PY" eval.py --model "$1" --dtype "$EVAL_DTYPE" --data "${EVAL_FILES[@]}")
  [ -z "$EVAL_LIMIT" ] || e+=(--limit "$EVAL_LIMIT")
  run "${e[@]}" --index "$INDEX" "${EVAL_CPU[@]}" --out_dir "$2" --overwrite --report_to "$REPORT_TO"
}
if [ "$EVAL_SFT" = 1 ]; then
  echo "== [5/5] eval.py on the SFT start (the number training is measured from): ${EVAL_FILES[*]} -> $OUT/eval_sft"
  if [ -f "$OUT/eval_sft/results.json" ]; then echo "  reused: $OUT/eval_sft/results.json"
  else evaluate "$SFT_DIR/hf" "$OUT/eval_sft"; fi
fi
echo "== [5/5] eval.py on the trained model $CKPT -> $OUT/eval"
evaluate "$CKPT" "$OUT/eval"
if [ "$DRY" = 1 ]; then echo "own_data_cpu.sh: dry run: ok"; else echo "== done: $OUT (tensorboard --logdir $OUT/tensorboard)"; fi
