#!/usr/bin/env bash
# Evaluate a model on the bundled eval sets (data/eval/*.jsonl) with search; see eval.py for every flag.
#   bash scripts/eval.sh                                  # SmolLM2 + in-process BM25, all rows
#   LIMIT=20 bash scripts/eval.sh                         # a quick slice (first 20 rows of each set)
#   MODEL=runs/x/checkpoints/step_000100/hf bash scripts/eval.sh   # -> runs/eval/x_step_000100
#   MODEL=runs/x bash scripts/eval.sh                     # the run's latest checkpoint
#   RETRIEVER_URL=http://127.0.0.1:8000 JUDGE_URL=http://127.0.0.1:8001 bash scripts/eval.sh
#   DATA=data/benchmarks JUDGE_URL=... bash scripts/eval.sh   # a folder of benchmarks (FlashRAG's nq/test.jsonl, ..,
#                                                             # Search-R1's test.parquet): one row each, SSP's order
#   ENGINE=hf bash scripts/eval.sh --max_turns 2          # extra args go to eval.py
#   DRY_RUN=1 MODEL=runs/x bash scripts/eval.sh           # resolve and print the settings; load nothing
# A MODEL inside a training run (train.py's output_dir) is evaluated under the run's rollout protocol
# (its config.json: turns, token caps, topk, template, dtype, the solver's search backend): TOPK,
# MAX_TURNS, INDEX and RETRIEVER_URL are passed on only when set, and then override the run's values.
# Outside a run, eval.py's defaults apply and the search backend is the BM25 index INDEX. A run whose
# retriever was stopped (the demo's) is searched through the run's index (eval.py says so).
# The python: PY, else $VENV/bin/python, else the active virtualenv's (scripts/setup_gpu.sh's .venv-gpu once
# sourced), else .venv/bin/python (scripts/setup_cpu.sh's), else .venv-gpu/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-data/models/SmolLM2-135M-Instruct}
DATA=${DATA:-$(ls data/eval/*.jsonl)}
INDEX_GIVEN=${INDEX:+yes}
INDEX=${INDEX:-data/indexes/bm25}
CORPUS=${CORPUS:-data/corpus/wiki.jsonl}
RETRIEVER_URL=${RETRIEVER_URL:-}
JUDGE_URL=${JUDGE_URL:-}
ENGINE=${ENGINE:-vllm}
LIMIT=${LIMIT:-}
TOPK=${TOPK:-}            # unset: the run's topk, else eval.py's default (3)
MAX_TURNS=${MAX_TURNS:-}  # unset: the run's max_turns, else eval.py's default (4)
if [ -z "${PY:-}" ]; then
  if [ -n "${VENV:-}" ]; then PY=$VENV/bin/python
  elif [ -n "${VIRTUAL_ENV:-}" ]; then PY=$VIRTUAL_ENV/bin/python
  elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
  elif [ -x .venv-gpu/bin/python ]; then PY=.venv-gpu/bin/python
  else PY=python3; fi
fi
command -v "$PY" >/dev/null || { echo "eval.sh: no python at $PY (set VENV= or PY=, or run scripts/setup_cpu.sh)" >&2; exit 1; }
DRY_RUN=${DRY_RUN:-0}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# vLLM in-process starts in seconds instead of tens of seconds (docs/PLATFORM_NOTES.md, vLLM start-up).
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}

[ -e "$MODEL" ] || { echo "eval.sh: model folder $MODEL not found; run $PY scripts/prepare_data.py or set MODEL=" >&2; exit 1; }
# "<run>_<step>" when MODEL lies in a training run (eval.py's locate_run), else empty
IN_RUN=$("$PY" -c 'import sys
from pathlib import Path
from eval import locate_run
try:
    hf, run = locate_run(sys.argv[1])
except ValueError:  # eval.py says why
    hf, run = "", None
print(f"{run.name}_{Path(hf).resolve().parent.name}" if run else "")' "$MODEL")
OUT_DIR=${OUT_DIR:-runs/eval/${IN_RUN:-$(basename "$MODEL")}}

args=(--model "$MODEL" --data $DATA --engine "$ENGINE" --out_dir "$OUT_DIR")
[ -n "$TOPK" ] && args+=(--topk "$TOPK")
[ -n "$MAX_TURNS" ] && args+=(--max_turns "$MAX_TURNS")
if [ -n "$RETRIEVER_URL" ]; then
  args+=(--retriever_url "$RETRIEVER_URL")
elif [ -n "$INDEX_GIVEN" ] || [ -z "$IN_RUN" ]; then
  if [ ! -f "$INDEX/manifest.json" ] && [ "$DRY_RUN" = 1 ]; then
    echo "eval.sh: would build the BM25 index $INDEX from $CORPUS first and pass --index $INDEX (not checked here)"
  else
    if [ ! -f "$INDEX/manifest.json" ]; then
      echo "eval.sh: building the BM25 index $INDEX from $CORPUS (once)"
      "$PY" -m retrieval.build_index --corpus "$CORPUS" --out "$INDEX" --kind bm25
    fi
    args+=(--index "$INDEX")
  fi
fi
[ -n "$JUDGE_URL" ] && args+=(--judge_url "$JUDGE_URL" --judge_cache "$OUT_DIR/judge_cache.sqlite")
[ -n "$LIMIT" ] && args+=(--limit "$LIMIT")

if [ "$DRY_RUN" = 1 ]; then  # eval.py's own resolution (the run's protocol, a stopped retriever), then stop
  echo "eval.sh: would run $PY eval.py ${args[*]} $*"
  "$PY" -c 'import sys
import eval as e
from utils.errors import InputError
a = e.parse_args(sys.argv[1:])
try:
    e.fall_back_from_a_stopped_retriever(a)
except InputError as err:
    sys.exit(f"eval.py: {err}")
print(e.settings_table(a))
print("eval.sh: dry run: ok")' "${args[@]}" "$@"
  exit 0
fi
mkdir -p "$OUT_DIR"
"$PY" eval.py "${args[@]}" "$@" 2>&1 | tee "$OUT_DIR/eval.log"
