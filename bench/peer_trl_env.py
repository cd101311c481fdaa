"""TRL in an overlay folder of its own, layered over .venv, so the project's pins never move.

    .venv/bin/python bench/peer_trl_env.py          # install (idempotent: ~1 s once done, ~10 s the first time)
    bash scripts/setup_trl.sh                        # the same

TRL 1.16.0 runs on the project's torch 2.13.0+cpu and transformers 5.19.0 (it warns that it was tested with vLLM
0.22-0.31; ours is 0.32). Its own requirements that .venv lacks are datasets (with multiprocess) and pandas; the rest
(accelerate, pyarrow, dill, xxhash, huggingface_hub, ...) are .venv's. So the overlay gets exactly those, with
`--no-deps`, and the processes that use TRL put the overlay first on PYTHONPATH: nothing else sees it.
TRL_OVERLAY moves the folder (default `.trl_overlay` at the repo root, which git ignores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# TRL and the packages of its requirements that .venv does not hold, pinned to the versions measured together.
PACKAGES = ["trl==1.16.0", "datasets==5.2.0", "pandas==3.1.1", "multiprocess==0.70.19"]
STAMP = ".installed"   # holds the package list: a different list reinstalls


def overlay_dir() -> Path:
    return Path(os.environ.get("TRL_OVERLAY", REPO / ".trl_overlay"))


def is_installed(overlay: Path | None = None) -> bool:
    overlay = overlay_dir() if overlay is None else overlay
    stamp = overlay / STAMP
    return stamp.exists() and stamp.read_text().split() == PACKAGES


def ensure_trl(overlay: Path | None = None, quiet: bool = True) -> Path:
    """Install PACKAGES into the overlay unless its stamp says they are there; return the overlay folder.
    Raises RuntimeError with pip's last lines when the install fails (no network, say)."""
    overlay = overlay_dir() if overlay is None else overlay
    if is_installed(overlay):
        return overlay
    overlay.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "--upgrade",
           "--target", str(overlay), *PACKAGES] + (["-q"] if quiet else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"pip could not install {' '.join(PACKAGES)} into {overlay}:\n{tail}")
    (overlay / STAMP).write_text(" ".join(PACKAGES) + "\n")
    return overlay


def overlay_env(overlay: Path | None = None, base: dict | None = None) -> dict:
    """An environment whose Python sees the overlay first, then the repo, then .venv's site-packages."""
    overlay = overlay_dir() if overlay is None else overlay
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(overlay), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


if __name__ == "__main__":
    path = ensure_trl(quiet=False)
    print(f"peer_trl_env: {' '.join(PACKAGES)} in {path} (use PYTHONPATH={path})")
