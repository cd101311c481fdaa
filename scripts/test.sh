#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite on CPU.
#   bash scripts/test.sh                 # whole suite (~19 min of pytest on a 2-core AVX-512 box; by CPU: docs/cpu.md)
#   bash scripts/test.sh -m "not slow"   # skip the multi-process end-to-end tests
#   bash scripts/test.sh tests/retrieval # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
# DeepSpeed JIT-builds its shm op on every fresh start (75-90 s); keep the build in a cached folder.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
# The data the tests read: corpus, eval sets, the converted SmolLM2 folder, the demo's BM25 index (idempotent, ~1 min
# the first time).
.venv/bin/python scripts/prepare_data.py
set +e
# Two workers (TEST_WORKERS=0 runs in one process): most tests run one process on one thread, so one worker
# leaves a core of a 2-core box idle. Whole files go to a worker, heaviest first (tests/conftest.py: HEAVY_FIRST).
# --durations: the 25 slowest tests in every log (CI's too), for the 20-minute aim (issue 43)
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: that must never count as a pass.
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; failing on purpose" >&2
  exit 1
fi
exit "$rc"
