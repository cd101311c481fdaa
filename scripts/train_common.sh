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
RETRIEVER_URL=${RETRIEVER_URL:-http://127.0.0.1:8000}   # one retriever per node: scripts/start_retriever.sh
JUDGE_URL=${JUDGE_URL:-}                                 # OpenAI-compatible judge (scripts/start_judge.sh); empty = EM only
JUDGE_MODEL=${JUDGE_MODEL:-}
# Proposer rows (answer + search_turns; SSP's parquet works). Unset, the scripts train on the CPU
# demo's pool (data/train/proposer.jsonl: 2000 answers that scripts/prepare_data.py draws from
# Wikipedia titles, so a wiki-18 retriever can find them). train.py refuses a demo default on CUDA
# or across nodes, so the scripts accept this one on purpose with --allow_demo_defaults true (and
# train.py says so at start-up); set TRAIN_DATA to your own rows and the flag is not passed.
demo=()
if [ -z "${TRAIN_DATA:-}" ]; then
  TRAIN_DATA=data/train/proposer.jsonl
  demo=(--allow_demo_defaults true)
fi
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
if [ -n "$JUDGE_URL" ]; then judge=(--judge llm --judge_url "$JUDGE_URL" --judge_model "$JUDGE_MODEL" --rag_verify judge); fi
read -r -a launcher <<< "${LAUNCHER_ARGS:-}"
cmd=(deepspeed --hostfile "$HOSTFILE" "${launcher[@]}" train.py
  --model_path "$MODEL" --template "$TEMPLATE" --dtype bf16 --gradient_checkpointing true
  --vllm_tp "$VLLM_TP" --gpu_memory_utilization "$GPU_MEM" --max_model_len 8192
  --max_turns 6 --max_tokens_per_turn 1024 --max_total_tokens 8192 --max_info_tokens 1024
  --retriever_url "$RETRIEVER_URL" --topk 3
  --train_data "$TRAIN_DATA" "${demo[@]}" --prompts_per_step "$PROMPTS_PER_STEP" --proposer_n 1 --solver_n "$SOLVER_N"
  "${judge[@]}"
  --proposer_estimator reinforce++ --solver_estimator "$ESTIMATOR" "${critic[@]}" --clip_low 0.2 --clip_high 0.28
  --lr "$LR" --warmup_steps 10 --total_steps "$STEPS" --micro_token_budget "$MICRO_TOKENS"
  --zero_stage 3 --offload_optimizer "$OFFLOAD"
  --output_dir "$OUT" --report_to "$REPORT_TO" --save_every 10 --max_ckpts 3
  "$@")
set -x
if [ "${DRY_RUN:-0}" = 1 ]; then
  "${cmd[@]}" --dry_run
else
  mkdir -p "$OUT"
  "${cmd[@]}" 2>&1 | tee -a "$OUT/train.log"
fi
