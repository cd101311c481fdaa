#!/usr/bin/env bash
# Install TRL (the peer bench/bench_peer_trl.py measures) into an overlay folder of its own, .trl_overlay
# (TRL_OVERLAY moves it), layered over .venv by PYTHONPATH in the bench's processes only: the project's pins and
# .venv stay as they are. Idempotent: a stamp in the overlay names the installed versions (bench/peer_trl_env.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || bash scripts/setup_cpu.sh
exec "$VENV/bin/python" bench/peer_trl_env.py
