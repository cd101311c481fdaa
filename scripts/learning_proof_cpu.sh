#!/usr/bin/env bash
# Does RL on this trainer learn, and does self-play add to it? The CPU learning proof as a ladder (issue 13):
#   1. install (scripts/setup_cpu.sh), data (prepare_data.py), BM25 index, the dtype measured on this
#      machine (python -m utils.cpu_dtype; DTYPE= overrides)
#   2. scripts/sft_coldstart.sh (shared with scripts/demo_cpu.sh): cold-start demos, leak-checked against
#      every eval set, then the SFT cold start of SmolLM2-135M-Instruct: the one start every rung shares
#   3. greedy held-out eval of the SFT export (the number every gain is measured from); the QA rows
#      data/train/solver_qa.jsonl split once into a dev split (the last DEV_ROWS) and RL training rows
#   4. rung 0, headroom: the SFT model's pass@PASSK (temperature 1) against its greedy EM, on the dev
#      split and on a held-out slice (the first PASSK_LIMIT rows of each held-out file)
#   5. rung 1, the RL core, per seed: solver-only RL on the training QA rows (--self_play_enable false),
#      held-out eval at each milestone in QA_STEPS
#   6. rung 2, SSP, per seed: both roles trained from proposer rows (answers from the corpus), held-out
#      eval at each milestone in STEPS
#   5b. rung 1 with a critic (issue 23, RUNGS token 1gae), per seed: rung 1's recipe with PPO's critic and GAE
#      (--solver_estimator gae) in place of GRPO's group baseline. The critic's forward and backward cost time,
#      so rung 1 gets the extra steps they buy (as rung 2 against rung 3): run it before rung 1's last milestone.
#   7. rung 3, SSP with self-distillation of the solver (issue 22), per seed: rung 2's recipe plus
#      --distill sampled (the proposer's search path as the teacher's privileged context), held-out eval at
#      each milestone in DISTILL_STEPS. Equal wall time with rung 2: the teacher forward costs time, so rung 2
#      gets the extra steps it buys. Under PROTOCOL the milestones of every arm are fixed in the protocol file
#      before the runs; without it bench/learning_proof.py reads the base rung at the milestone nearest the
#      dearer rung's wall time and says that choice was not pre-registered
#   The rungs run interleaved, seed by seed (seed 1 of each rung asked for, then seed 2, ...)
#   8. bench/learning_proof.py: one plot of the RL rungs (bench/learning_proof.png), the sections
#      learning_headroom, learning_qa, learning and learning_distill of bench/RESULTS.md, their keys in
#      bench/results.json
#
#   OUT=runs/learning_protocol PROTOCOL=bench/learning_protocol.json bash scripts/learning_proof_cpu.sh
#                                  # issue 41's pre-registered runs: seeds, milestones, dev reads and the SSP recipe
#                                  # from the protocol file, arms interleaved seed by seed (docs/results.md, "Protocol")
#   bash scripts/learning_proof_cpu.sh                       # rungs 0-3, 3 seeds, the defaults below (10-14 steps):
#                                  # NOT the runs bench/RESULTS.md reports (each section names its own steps and recipe)
#   OUT=runs/learning_protocol RUNGS=2 SEEDS="101 102" STEPS=30 DEV_EVERY=10 HELDOUT_EVAL=0 SSP_PREFIX=sweep_B_seed \
#     SSP_EXTRA="--rag_verify retrieval --shortcut_filter off" bash scripts/learning_proof_cpu.sh   # one sweep candidate
#   RUNGS=3 DISTILL_COEF=0.02 bash scripts/learning_proof_cpu.sh   # another rung-3 setting: first move runs/learning_proof/distill_seed* aside
#   RUNGS=3 DISTILL=contrast bash scripts/learning_proof_cpu.sh    # rung 3 with --distill contrast (issue 32; aside as above)
#   RUNGS="1" SEEDS="1 2" QA_STEPS="10 30" bash scripts/learning_proof_cpu.sh
#   RUNGS="1gae 1" QA_STEPS="10 N" bash scripts/learning_proof_cpu.sh   # rung 1 with a critic, then rung 1 at equal
#                                                  # wall time (N from the critic's share, printed by the report)
#
# Records (issue 41): every train.py and eval.py launch appends its commit, command line, start time, cores and load
# average to run_meta.jsonl in its own folder; bench/learning_proof.py lists them beside the numbers.
# Every stage is skipped when its output exists, and train.py resumes from its last checkpoint, so
# re-running the same line after a crash continues where it stopped. The seeds differ in the RL run
# (sampling, data order, game seeds); the SFT start and the held-out protocol are shared.
# Held-out eval (never trained on, never used to pick a setting): wiki_desc_heldout (300 description
# questions kept out of the demos and the RL rows' answers: the in-distribution test), capitals,
# FanOutQA single- and multi-hop. Settings are chosen from the training games and the dev split only.
# Recipe (see the closing note of issue 13 and bench/RESULTS.md):
#   --train_top_layers 8 of 30: backward and optimizer only on the top layers; frozen layers are never
#   re-sent to vLLM. --max_info_tokens 160: three documents cut to 160 tokens (most of a row is documents).
#   --old_logprobs rollout: vLLM's log-probs serve as the ratio's old log-probs (saves a forward; the
#   actor re-scores a sample each step for actor/rollout_lp_gap). --ppo_mini_batches 2: two optimizer steps
#   per batch, so the ratio leaves 1 and clipping acts (veRL/SSP mini-batches; generation is the costly part).
#   Rung 2 (issue 31): 3 turns allow 2 searches and every proposer row asks for n = 2; the RAG check runs on
#   the policy, reading what a solver's searches would show (--rag_verify policy), so the proposer is paid
#   SSP's 1-acc for answerable questions, -1 for an invalid one; one search is enough (--min_searches 1:
#   the SFT proposer searched its own answer twice in 1 of 4 rollouts, which 2 refuses); the pool keeps
#   questions some but not all solvers answered. Each setting and what it did: bench/RESULTS.md,
#   section learning_game_settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/learning_proof}
RUNGS_SET=${RUNGS:+yes}   # with PROTOCOL, RUNGS defaults to the protocol's primary arms ("1 2")
RUNGS=${RUNGS:-"0 1gae 1 2 3"}
SEEDS=${SEEDS:-"1 2 3"}
QA_STEPS=${QA_STEPS:-"10"}     # rung 1 milestones: held-out eval at each (~53 s a step on 2 cores, bench/RESULTS.md learning_qa)
STEPS=${STEPS:-"10 14"}        # rung 2 milestones (~40 s a step on the live game, section learning_ssp_vs_qa). These
                               # defaults are neither the reported runs' steps (rung 1: 24, rung 2: 15 30) nor the
                               # protocol's (bench/learning_protocol.json)
DISTILL_STEPS=${DISTILL_STEPS:-"10"}   # rung 3 milestones
GAE_STEPS=${GAE_STEPS:-"10"}           # rung 1gae milestones
CRITIC_LR=${CRITIC_LR:-1e-4}           # rung 1gae: the critic's LR (2x the actor's; fixed before any result)
DISTILL=${DISTILL:-sampled}             # rung 3: --distill form (sampled, contrast or topk)
DISTILL_COEF=${DISTILL_COEF:-0.1}      # rung 3: beta of the distillation term
DISTILL_CONTEXT=${DISTILL_CONTEXT:-512}  # rung 3: token budget of the teacher's privileged block
SFT_DEMOS=${SFT_DEMOS:-960}
SFT_DIR=${SFT_DIR:-$OUT/sft}   # the SFT start every rung shares; an export already there is reused
LR=${LR:-5e-5}
QA_PROMPTS=${QA_PROMPTS:-8}    # rung 1: fixed QA questions per step
PROMPTS=${PROMPTS:-8}          # rung 2: proposer prompts per step
SOLVER_N=${SOLVER_N:-8}        # G_s, both rungs
MINI=${MINI:-2}                # --ppo_mini_batches
# Rung 2's game (issue 31; each setting tried on the training games, bench/RESULTS.md section learning_game_settings):
FORMAT_PENALTY=${FORMAT_PENALTY:--1}      # an invalid question below every valid one (SSP ships 0)
RAG_VERIFY=${RAG_VERIFY:-policy}          # the RAG check reads the solver's own view (inference/rag_check.solver_view)
RAG_DISTRACTORS=${RAG_DISTRACTORS:-0}     # 0: with 2 other trajectories' searches shuffled in, the 135M verifier
                                          # refused 5 of 8 questions a step and the game died (valid 0.04 over 7 steps,
                                          # against 0.20 with 0 and every other setting alike)
PROPOSER_REWARD=${PROPOSER_REWARD:-1-acc} # SSP's: with the RAG check, the harder an answerable question the better
MIN_SEARCHES=${MIN_SEARCHES:-1}           # SSP needs 2; the SFT proposer searched its answer twice in 1 of 4 rollouts
POOL_SOLVE=${POOL_SOLVE:-"0.01 0.99"}     # the pool admits questions some but not all solvers answered
SSP_EXTRA=${SSP_EXTRA:-}                  # rung 2 (and 3): more train.py flags, e.g. a lever tried on the dev split
SSP_PREFIX=${SSP_PREFIX:-seed}            # rung 2's run folders <OUT>/<SSP_PREFIX><seed> (a sweep candidate's own)
DEV_EVERY=${DEV_EVERY:-0}                 # > 0: every RL run reads the dev split every N steps (train.py --eval_data:
                                          # eval/em in metrics.jsonl), beside the held-out eval at its milestones
HELDOUT_EVAL=${HELDOUT_EVAL:-1}           # 0: no held-out eval and no report (a sweep on the dev split; one milestone)
PROTOCOL=${PROTOCOL:-}                    # bench/learning_protocol.json: its seeds, milestones, dev reads, SSP recipe
PASSK=${PASSK:-8}
PASSK_LIMIT=${PASSK_LIMIT:-30}
DEV_ROWS=${DEV_ROWS:-200}
QA_ROWS=${QA_ROWS:-data/train/solver_mix.jsonl}          # rung 1's QA rows (dataprep/reading_sets.py); dev split = its tail
PROPOSER_ROWS=${PROPOSER_ROWS:-data/train/proposer_mix.jsonl}  # rung 2's answer pool
EVAL_LIMIT=${EVAL_LIMIT:-}      # empty = every held-out row (the protocol); a number = the first N of each file (smoke tests)
MAX_TOKENS_PER_TURN=${MAX_TOKENS_PER_TURN:-64}  # the protocol's tokens per model turn, RL and eval alike (the measured
                                                # runs used 64; the smoke test's 16 cuts its generation, not its path)
NAME=${NAME:-learning}   # rung 2's RESULTS.md section / results.json prefix; another recipe: NAME=learning_lr1e-4 LR=1e-4 OUT=...
EVAL_FILES=(data/eval/reading_heldout.jsonl data/eval/twohop_heldout.jsonl data/eval/capitals.jsonl
            data/eval/fanoutqa_singlehop.jsonl data/eval/fanoutqa_multihop.jsonl data/eval/wiki_desc_heldout.jsonl)
HELDOUT=(--data "${EVAL_FILES[@]}" ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"})

bash scripts/setup_cpu.sh
PY=.venv/bin/python
if [ -n "$PROTOCOL" ]; then   # issue 41's pre-registered runs: the protocol's numbers replace the defaults above
  PROTO_SH=$($PY -m bench.learning_compare --shell "$PROTOCOL")   # refuses while the sweep has not chosen the recipe
  eval "$PROTO_SH"
  [ -n "$RUNGS_SET" ] || RUNGS="1 2"
  for r in $RUNGS; do [[ " 1 2 3 " == *" $r "* ]] || { echo "learning_proof: PROTOCOL runs rungs 1, 2 and 3 only" \
    "(got RUNGS=\"$RUNGS\")" >&2; exit 1; }; done
  echo "== protocol $PROTOCOL: seeds $SEEDS, rung 1 read at step $QA_STEPS, SSP at $STEPS, dev split every $DEV_EVERY"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
mkdir -p "$OUT"
TIMES="$OUT/timings.tsv"
stamp() { echo -e "$1\t$2\t$3" >> "$TIMES"; }   # stage, seconds, seed
has_rung() { [[ " $RUNGS " == *" $1 "* ]]; }

hf_export_done() {  # config plus one safetensors file or the index of its shards
  [ -f "$1/config.json" ] && { [ -f "$1/model.safetensors" ] || [ -f "$1/model.safetensors.index.json" ]; }
}

echo "== [1/8] data, BM25 index, dtype"
$PY scripts/prepare_data.py
[ -f data/indexes/bm25/manifest.json ] || $PY -m retrieval.build_index --corpus data/corpus/wiki.jsonl \
  --out data/indexes/bm25 --kind bm25
export DTYPE=${DTYPE:-$($PY -m utils.cpu_dtype --verbose --keep_in "$OUT")}   # SFT, RL and eval alike; kept in $OUT/dtype for reruns
EVAL_DTYPE=$([ "$DTYPE" = bf16 ] && echo bfloat16 || echo float32)

# Shared rollout protocol of SFT rendering, RL and eval (kept identical on purpose).
PROTO=(--max_turns 3 --max_tokens_per_turn "$MAX_TOKENS_PER_TURN" --max_total_tokens 1024 --max_info_tokens 160)

echo "== [2/8] cold-start demos and SFT cold start ($SFT_DEMOS demos; scripts/sft_coldstart.sh, shared with the demo)"
had_sft=false; hf_export_done "$SFT_DIR/hf" && had_sft=true
t=$(date +%s)
COLDSTART=${COLDSTART:-data/train/coldstart_mix.jsonl} SFT_DEMOS=$SFT_DEMOS SFT_MAX_INFO_TOKENS=160 SFT_THREADS=$OMP_NUM_THREADS bash scripts/sft_coldstart.sh "$SFT_DIR"
$had_sft || stamp sft $(( $(date +%s) - t )) -

record() {  # folder command...: one JSON line per launch into <folder>/run_meta.jsonl: its commit, whether the
            # measured code had uncommitted changes, its command line, start time, cores and load (issue 41)
  local dir=$1; shift
  mkdir -p "$dir"
  PROTOCOL="$PROTOCOL" $PY - "$dir/run_meta.jsonl" "$@" <<'PYEOF'
import json, os, subprocess, sys, time
def git(*a):
    try:
        p = subprocess.run(["git", *a], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None
measured = ["eval.py", "inference", "scripts/learning_proof_cpu.sh", "train.py", "training"]  # = LADDER_MEASURES
row = {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain", "--", *measured)),
       "argv": sys.argv[2:], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cores": os.cpu_count(),
       "load1": round(os.getloadavg()[0], 2), "omp_threads": os.environ.get("OMP_NUM_THREADS"),
       "protocol": os.environ.get("PROTOCOL") or None}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(row) + "\n")
PYEOF
}

evaluate() {  # model_dir out_dir [eval.py args]; run only while out_dir has no results.json
  local model=$1 dir=$2; shift 2
  [ -f "$dir/results.json" ] && return 0
  local cmd=($PY eval.py --model "$model" --dtype "$EVAL_DTYPE" --index data/indexes/bm25 "${PROTO[@]}"
    --max_model_len 1024 --kv_cache_mb 1024 --batch_size 128 --out_dir "$dir" --overwrite "$@")
  "${cmd[@]}" 2>&1 | tail -12
  record "$dir" "${cmd[@]}"
}

echo "== [3/8] held-out eval of the SFT checkpoint; dev split of the QA rows"
if [ "$HELDOUT_EVAL" = 1 ] && [ ! -f "$OUT/eval_sft/results.json" ]; then
  t=$(date +%s); evaluate "$SFT_DIR/hf" "$OUT/eval_sft" "${HELDOUT[@]}"; stamp eval_sft $(( $(date +%s) - t )) -
fi
if [ ! -f "$OUT/qa_dev.jsonl" ]; then  # the file is shuffled at a fixed seed: its tail is a random dev split
  head -n "-$DEV_ROWS" "$QA_ROWS" > "$OUT/qa_train.jsonl.tmp"
  tail -n "$DEV_ROWS" "$QA_ROWS" | sed 's/"data_source": "\([a-z_]*\)"/"data_source": "\1_dev"/' > "$OUT/qa_dev.jsonl.tmp"
  mv "$OUT/qa_train.jsonl.tmp" "$OUT/qa_train.jsonl"; mv "$OUT/qa_dev.jsonl.tmp" "$OUT/qa_dev.jsonl"
fi

if has_rung 0; then
  echo "== [4/8] rung 0, headroom: SFT greedy vs pass@$PASSK on the dev split and a held-out slice"
  t=$(date +%s)
  evaluate "$SFT_DIR/hf" "$OUT/eval_sft_dev" --data "$OUT/qa_dev.jsonl"
  evaluate "$SFT_DIR/hf" "$OUT/passk_dev" --data "$OUT/qa_dev.jsonl" --samples "$PASSK" --temperature 1.0 --seed 1
  evaluate "$SFT_DIR/hf" "$OUT/eval_sft_slice" --data "${EVAL_FILES[@]}" --limit "$PASSK_LIMIT"
  evaluate "$SFT_DIR/hf" "$OUT/passk_slice" --data "${EVAL_FILES[@]}" --limit "$PASSK_LIMIT" --samples "$PASSK" \
    --temperature 1.0 --seed 1
  stamp headroom $(( $(date +%s) - t )) -
fi

# RL recipe shared by both rungs
COMMON=(--model_path "$SFT_DIR/hf" --dtype "$DTYPE" --gradient_checkpointing false --train_top_layers 8
  --index data/indexes/bm25 "${PROTO[@]}" --max_model_len 1024 --micro_token_budget 4096 --kv_cache_mb 1024
  --old_logprobs rollout --lr "$LR" --warmup_steps 0 --lr_schedule constant --ppo_mini_batches "$MINI"
  --solver_n "$SOLVER_N" --solver_estimator grpo --save_every 5 --max_ckpts 1 --sample_every 5 --dump_rollouts true)
if [ "$DEV_EVERY" -gt 0 ]; then   # the dev split read inside the run (eval/em in metrics.jsonl), cheap and often
  COMMON+=(--eval_data "$OUT/qa_dev.jsonl" --eval_every "$DEV_EVERY" --eval_limit "$DEV_ROWS")
fi
QA_ARGS=(--self_play_enable false --proposer_enable false --qa_data "$OUT/qa_train.jsonl" --prompts_per_step "$QA_PROMPTS")
read -r POOL_MIN POOL_MAX <<< "$POOL_SOLVE"
SSP_ARGS=(--train_data "$PROPOSER_ROWS" --prompts_per_step "$PROMPTS" --proposer_n 1 --min_searches "$MIN_SEARCHES"
  --min_question_words 4 --rag_verify "$RAG_VERIFY" --rag_distractors "$RAG_DISTRACTORS"
  --proposer_reward "$PROPOSER_REWARD" --format_penalty "$FORMAT_PENALTY"
  --pool_min_solve_rate "$POOL_MIN" --pool_max_solve_rate "$POOL_MAX" --proposer_estimator reinforce++ $SSP_EXTRA)
GAE_ARGS=("${QA_ARGS[@]}" --solver_estimator gae --critic_lr "$CRITIC_LR" --critic_train_top_layers 8
  --critic_gradient_checkpointing false)
DISTILL_ARGS=("${SSP_ARGS[@]}" --distill "$DISTILL" --distill_coef "$DISTILL_COEF" --distill_context_tokens "$DISTILL_CONTEXT")

ladder() {  # rung prefix rl_stage eval_stage milestones train-args...
  local rung=$1 prefix=$2 rl_stage=$3 ev_stage=$4 milestones=$5; shift 5
  for SEED in $LADDER_SEEDS; do
    RUN="$OUT/$prefix$SEED"
    for M in $milestones; do   # train on to step M (resuming), then evaluate the step-M export
      if [ -f "$RUN/eval_step$M/results.json" ]; then continue; fi
      CKPT="$RUN/checkpoints/step_$(printf %06d "$M")/hf"
      if ! hf_export_done "$CKPT"; then
        echo "== [$rung] seed $SEED: RL up to step $M from the SFT checkpoint -> $RUN"
        t=$(date +%s)
        local cmd=($PY train.py "${COMMON[@]}" "$@" --total_steps "$M" --seed "$SEED" --output_dir "$RUN")
        record "$RUN" "${cmd[@]}"
        "${cmd[@]}" 2>&1 | tee -a "$RUN.log"
        stamp "$rl_stage" $(( $(date +%s) - t )) "$SEED"
      fi
      hf_export_done "$CKPT" || { echo "learning_proof: $CKPT is missing (the run went past step $M" \
        "before it was evaluated); delete $RUN to redo seed $SEED" >&2; exit 1; }
      [ "$HELDOUT_EVAL" = 1 ] || continue   # a sweep run: the dev split only
      echo "== [$rung] seed $SEED: held-out eval of the step-$M checkpoint"
      t=$(date +%s)
      evaluate "$CKPT" "$RUN/eval_step$M" "${HELDOUT[@]}"
      stamp "$ev_stage$M" $(( $(date +%s) - t )) "$SEED"
    done
    if [[ "$prefix" != qa* ]] || [ "$HELDOUT_EVAL" = 0 ]; then  # the dev split at the last milestone: settings
      local last=${milestones##* }         # are chosen from it, never from held-out sets
      evaluate "$RUN/checkpoints/step_$(printf %06d "$last")/hf" "$RUN/dev_step$last" --data "$OUT/qa_dev.jsonl"
    fi
  done
}
run_rungs() {  # the RL rungs asked for, for the seeds in LADDER_SEEDS
  if has_rung 1gae; then ladder "5/8 rung 1 gae" qa_gae_seed rl_qa_gae eval_qa_gae_step "$GAE_STEPS" "${GAE_ARGS[@]}"; fi
  if has_rung 1; then ladder "5/8 rung 1" qa_seed rl_qa eval_qa_step "$QA_STEPS" "${QA_ARGS[@]}"; fi
  if has_rung 2; then ladder "6/8 rung 2" "$SSP_PREFIX" rl eval_step "$STEPS" "${SSP_ARGS[@]}"; fi
  if has_rung 3; then ladder "7/8 rung 3" distill_seed rl_distill eval_distill_step "$DISTILL_STEPS" "${DISTILL_ARGS[@]}"; fi
}
# The arms interleaved seed by seed (issue 41's clocks): seed 1 of every rung, then seed 2, ..., so that slow drift of
# the machine falls on every arm alike. No rung's milestone depends on another's clock any more.
for S in $SEEDS; do LADDER_SEEDS=$S; run_rungs; done

if [ "$HELDOUT_EVAL" = 0 ]; then
  echo "== no held-out eval (HELDOUT_EVAL=0), so no report: bench/game_report.py reads the runs' games and dev EM"
  exit 0
fi
echo "== [8/8] plot and tables"
BENCH_OUT=${BENCH_RESULTS_DIR:-bench}   # where RESULTS.md, results.json and the plot go (bench/report.py reads it too)
PNG=$BENCH_OUT/learning_proof.png; [ "$NAME" = learning ] || PNG="$BENCH_OUT/${NAME}.png"
REPORT=(--out "$OUT" --seeds $SEEDS --name "$NAME" --png "$PNG")
has_rung 0 && REPORT+=(--passk "$PASSK")
has_rung 1 && REPORT+=(--qa_steps $QA_STEPS)
has_rung 1gae && REPORT+=(--qa_gae_steps $GAE_STEPS)
has_rung 2 && REPORT+=(--steps $STEPS)
has_rung 3 && REPORT+=(--distill_steps $DISTILL_STEPS)
$PY bench/learning_proof.py "${REPORT[@]}"
