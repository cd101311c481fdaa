#!/usr/bin/env bash
# SSP on Qwen/Qwen3-8B, sized for 8x80GB nodes. Untested on GPU in this repo's CI (no GPU is lent to it).
#   bash scripts/train_qwen3_8b.sh HOSTFILE [extra train.py flags]
#   MODEL=/models/local-copy RETRIEVER_URL=http://127.0.0.1:8000 JUDGE_URL=http://judge:8001/v1 bash scripts/train_qwen3_8b.sh hostfile
# Defaults: vLLM TP=1 across neighbouring ranks, 256 prompts per step, ZeRO-3.
export MODEL=${MODEL:-Qwen/Qwen3-8B}
# TEMPLATE: the tokenizer's own chat template; TEMPLATE=qwen3 is the same format written out
export TEMPLATE=${TEMPLATE:-auto}
export VLLM_TP=${VLLM_TP:-1}
export PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-256}
export OFFLOAD=${OFFLOAD:-false}
export GPU_MEM=${GPU_MEM:-0.35}
source "$(dirname "$0")/train_common.sh" "$@"
