#!/usr/bin/env bash
# SSP on Qwen/Qwen2.5-14B, sized for 8x80GB nodes. Untested on GPU in this repo's CI (no GPU is lent to it).
#   bash scripts/train_qwen2.5_14b_base.sh HOSTFILE [extra train.py flags]
#   MODEL=/models/local-copy RETRIEVER_URL=http://127.0.0.1:8000 JUDGE_URL=http://judge:8001/v1 bash scripts/train_qwen2.5_14b_base.sh hostfile
# Defaults: vLLM TP=2 across neighbouring ranks, 256 prompts per step, ZeRO-3.
export MODEL=${MODEL:-Qwen/Qwen2.5-14B}
export TEMPLATE=${TEMPLATE:-r_search}
export VLLM_TP=${VLLM_TP:-2}
export PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-256}
export OFFLOAD=${OFFLOAD:-false}
# ESTIMATOR=gae: the critic's optimizer in host RAM, or the generate phase would need ~84 GB (memory plan)
export CRITIC_OFFLOAD=${CRITIC_OFFLOAD:-true}
export GPU_MEM=${GPU_MEM:-0.35}
source "$(dirname "$0")/train_common.sh" "$@"
