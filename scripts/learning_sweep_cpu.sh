#!/usr/bin/env bash
# Issue 41's sweep, as bench/learning_protocol.json ("sweep") fixes it: candidate after candidate, each a run of
# scripts/learning_proof_cpu.sh on the dev split only (HELDOUT_EVAL=0), until bench/learning_sweep.py says the sweep
# has chosen the SSP recipe. Re-run the same line after a crash: finished runs are kept, a stopped run resumes.
#   OUT=runs/learning_protocol bash scripts/learning_sweep_cpu.sh
#   DRY_RUN=1 bash scripts/learning_sweep_cpu.sh        # say what runs next (or what was chosen), run nothing
# Then the amending commit: `.venv/bin/python -m bench.learning_sweep --out "$OUT" --amend` writes the chosen flags into
# arms.ssp.flags of the protocol (and, for candidate E, its milestones); commit that file on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/learning_protocol}
PROTOCOL=${PROTOCOL:-bench/learning_protocol.json}
PY=${PY:-.venv/bin/python}
while true; do
  eval "$($PY -m bench.learning_sweep --out "$OUT" --protocol "$PROTOCOL")"
  if [ "$CHOSEN" = 1 ]; then
    echo "== sweep: chose $LABEL: $FLAGS"
    exit 0
  fi
  echo "== sweep: next candidate $LABEL: $FLAGS (seeds $SEEDS, $STEPS steps)"
  [ "${DRY_RUN:-0}" = 1 ] && exit 0
  OUT="$OUT" RUNGS=2 SEEDS="$SEEDS" STEPS="$STEPS" DEV_EVERY="$DEV_EVERY" HELDOUT_EVAL=0 \
    SSP_PREFIX="sweep_${LABEL}_seed" SSP_EXTRA="$FLAGS" bash scripts/learning_proof_cpu.sh
done
