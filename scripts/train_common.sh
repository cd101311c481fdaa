#!/usr/bin/env bash
# Shared launcher of the per-model-size scripts (scripts/train_<model>.sh). Not run directly.
# Those scripts set MODEL/TEMPLATE/VLLM_TP/... and source this file with the hostfile as $1.
# Every variable below can be overridden from the environment; extra arguments go to train.py.
# DRY_RUN=1 adds --dry_run: parse, validate, print the resolved and DeepSpeed configs, check that
# config with deepspeed.initialize on a stand-in model, and exit (no output dir, no log file).
# ESTIMATOR is the solver's advantage estimator (default grpo; the proposer keeps reinforce++, since
# G_p = 1). ESTIMATOR=gae is PPO with a critic: its own ZeRO-3 engine at CRITIC_LR (default 1e-5, Search-R1's
# and veRL's), its optimizer offloaded when CRITIC_OFFLOAD=true (default: OFFLOAD, as the actor; the 14B
# scripts default it to true, where a resident critic would not fit 80 GB); gamma = lambda = 1 (the defaults).
# REPORT_TO is --report_to (default tensorboard): a comma list of tensorboard, wandb, mlflow, e.g.
# REPORT_TO=tensorboard,wandb WANDB_PROJECT=ssp; MLflow reads MLFLOW_TRACKING_URI (default: a store in $OUT/mlflow).
# LAUNCHER_ARGS are extra flags of the deepspeed launcher, e.g. for one machine without ssh:
#   LAUNCHER_ARGS="--no_ssh_check --master_addr 127.0.0.1" (hostfile line: 'localhost slots=8').
# The game is the recipe that plays (scripts/recipe.sh, GAME: the RAG check on the policy, 1-acc, penalty -1, the pool's
# solve-rate window), as on CPU; with JUDGE_URL the judge takes the verifier's place (--rag_verify judge), as in SSP.
# Your own data (formats: docs/data.md), the same files scripts/own_data_cpu.sh takes on CPU:
#   TRAIN_DATA  proposer answer rows (below)        QA_DATA  labelled QA rows: they seed the question pool (--pool_init)
#   EVAL_DATA   eval sets, space- or comma-separated: train.py evaluates on them at the end (and every EVAL_EVERY steps)
#   CORPUS      your documents: indexed once (BM25, scripts/build_index.sh) into $OUT/index/bm25 and searched in-process
#               on every rank (--index), unless RETRIEVER_URL is set (then a retriever serving them answers: at wiki-18
#               scale serve one per node, scripts/start_retriever.sh). Across nodes, $OUT must be on shared storage.
#   INDEX       an index folder you built already, searched in-process on every rank (--index), instead of a server
# Every file given is read whole first (python -m dataprep.check_inputs), DRY_RUN=1 included: a bad row is named by
# file and line before the launcher starts (a file not on this machine: listed under DRY_RUN=1, refused otherwise).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: bash $0 HOSTFILE [extra train.py flags]   (hostfile lines: 'node1 slots=8')" >&2
  exit 2
fi
HOSTFILE=$1; shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${MODEL:?MODEL (an HF model folder, or a hub id such as Qwen/Qwen2.5-7B) must be set}"
RUN_NAME=${RUN_NAME:-$(basename "$MODEL")-ssp}
OUT=${OUT:-runs/$RUN_NAME}
RETRIEVER_GIVEN=${RETRIEVER_URL:+yes}
RETRIEVER_URL=${RETRIEVER_URL:-http://127.0.0.1:8000}   # one retriever per node: scripts/start_retriever.sh
JUDGE_URL=${JUDGE_URL:-}                                 # OpenAI-compatible judge (scripts/start_judge.sh); empty = EM only
JUDGE_MODEL=${JUDGE_MODEL:-}
# Proposer rows (answer + search_turns; SSP's parquet works). Unset, the scripts train on the CPU
# demo's pool (data/train/proposer.jsonl: 2000 answers that scripts/prepare_data.py draws from
# Wikipedia titles, so a wiki-18 retriever can find them). train.py refuses a demo default on CUDA
# or across nodes, so the scripts accept this one on purpose with --allow_demo_defaults true (and
# train.py says so at start-up); set TRAIN_DATA to your own rows and the flag is not passed.
demo=()
own=("${TRAIN_DATA:-}" "${QA_DATA:-}" "${EVAL_DATA:-}" "${CORPUS:-}" "${INDEX:-}")
if [ -z "${TRAIN_DATA:-}" ]; then
  TRAIN_DATA=data/train/proposer.jsonl
  demo=(--allow_demo_defaults true)
fi
QA_DATA=${QA_DATA:-}
EVAL_DATA=${EVAL_DATA:-}
EVAL_EVERY=${EVAL_EVERY:-0}
CORPUS=${CORPUS:-}
INDEX=${INDEX:-}
TEMPLATE=${TEMPLATE:-auto}
VLLM_TP=${VLLM_TP:-1}
GPU_MEM=${GPU_MEM:-0.35}
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-256}
SOLVER_N=${SOLVER_N:-5}
LR=${LR:-1e-6}
STEPS=${STEPS:-200}
OFFLOAD=${OFFLOAD:-false}
MICRO_TOKENS=${MICRO_TOKENS:-16384}
ESTIMATOR=${ESTIMATOR:-grpo}
REPORT_TO=${REPORT_TO:-tensorboard}
critic=()
if [ "$ESTIMATOR" = gae ]; then
  critic=(--critic_lr "${CRITIC_LR:-1e-5}" --critic_offload_optimizer "${CRITIC_OFFLOAD:-$OFFLOAD}" --critic_warmup "${CRITIC_WARMUP:-0}")
fi
judge=(--judge em)
if [ -n "$JUDGE_URL" ]; then
  judge=(--judge llm --judge_url "$JUDGE_URL" --judge_model "$JUDGE_MODEL")
  RAG_VERIFY=${RAG_VERIFY:-judge}
fi
source scripts/recipe.sh   # GAME: the recipe that plays (its CPU-only settings, GAME_CPU, are not used here)
# the search back-end: a retriever server (RETRIEVER_URL), or an index on every rank (INDEX, or CORPUS indexed here)
search=(--retriever_url "$RETRIEVER_URL")
build_index=()
if [ -z "$INDEX" ] && [ -n "$CORPUS" ] && [ -z "$RETRIEVER_GIVEN" ]; then
  INDEX=$OUT/index/bm25
  [ -f "$INDEX/manifest.json" ] || build_index=(env CORPUS="$CORPUS" OUT="$OUT/index" KINDS=bm25 bash scripts/build_index.sh)
fi
[ -z "$INDEX" ] || search=(--index "$INDEX")
data=()
[ -z "$QA_DATA" ] || data+=(--pool_init "$QA_DATA")
if [ -n "$EVAL_DATA" ]; then
  read -r -a evals <<< "${EVAL_DATA//,/ }"
  data+=(--eval_data "$(IFS=,; echo "${evals[*]}")" --eval_every "$EVAL_EVERY")
fi
if [ -n "${own[*]// /}" ]; then   # the user's files, read whole before the launcher starts
  PY=${PY:-$(command -v python || command -v python3)}
  check=("$PY" -m dataprep.check_inputs)
  [ "${DRY_RUN:-0}" != 1 ] || check+=(--missing_ok)   # a dry run on a login node lists files it cannot see
  [ -n "${demo[*]}" ] || check+=(--train_data "$TRAIN_DATA")
  [ -z "$QA_DATA" ] || check+=(--qa_data "$QA_DATA")
  [ -z "$EVAL_DATA" ] || check+=(--eval_data "${evals[@]}")
  [ -z "$CORPUS" ] || check+=(--corpus "$CORPUS")
  [ -z "$INDEX" ] || check+=(--index "$INDEX")
  "${check[@]}" || { echo "$(basename "$0"): fix the file(s) named above; each format, with an example: docs/data.md" >&2; exit 2; }
fi
read -r -a launcher <<< "${LAUNCHER_ARGS:-}"
cmd=(deepspeed --hostfile "$HOSTFILE" "${launcher[@]}" train.py
  --model_path "$MODEL" --template "$TEMPLATE" --dtype bf16 --gradient_checkpointing true
  --vllm_tp "$VLLM_TP" --gpu_memory_utilization "$GPU_MEM" --max_model_len 8192
  --max_turns 6 --max_tokens_per_turn 1024 --max_total_tokens 8192 --max_info_tokens 1024
  "${search[@]}" --topk 3
  --train_data "$TRAIN_DATA" "${demo[@]}" "${data[@]}" --prompts_per_step "$PROMPTS_PER_STEP" --proposer_n 1
  --solver_n "$SOLVER_N" "${judge[@]}" "${GAME[@]}"
  --proposer_estimator reinforce++ --solver_estimator "$ESTIMATOR" "${critic[@]}" --clip_low 0.2 --clip_high 0.28
  --lr "$LR" --warmup_steps 10 --total_steps "$STEPS" --micro_token_budget "$MICRO_TOKENS"
  --zero_stage 3 --offload_optimizer "$OFFLOAD"
  --output_dir "$OUT" --report_to "$REPORT_TO" --save_every 10 --max_ckpts 3
  "$@")
if [ ${#build_index[@]} -gt 0 ]; then
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '+ would build the index first:'; printf ' %q' "${build_index[@]}"; echo
  else
    "${build_index[@]}"
  fi
fi
set -x
if [ "${DRY_RUN:-0}" = 1 ]; then
  "${cmd[@]}" --dry_run
else
  mkdir -p "$OUT"
  "${cmd[@]}" 2>&1 | tee -a "$OUT/train.log"
fi
