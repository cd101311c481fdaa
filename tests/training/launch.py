"""torchrun launches of the training tests' worker scripts (tests/training/*_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch_worker(model_dir: Path, out_dir: Path, worker: str, world: int, *extra: str, timeout: int = 600) -> dict:
    """tests/training/<worker>.py under torchrun at `world` ranks on the model, one thread per rank;
    returns the JSON the worker writes to the path it is given (a file in out_dir)."""
    from utils.dist import free_port

    out = out_dir / f"{worker}_{world}{'_'.join(extra)}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(REPO / "tests" / "training" / f"{worker}.py"), str(model_dir), str(out), *extra]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def phases_from_argv(argv: list[str], allowed: tuple[str, ...], default: str, apart: tuple[str, str]) -> list[str]:
    """A worker's --phases=a,b (default `default`): known names, each once, in the order of `allowed`, and
    never both of `apart` (the negative control's patch stays installed for what runs after it)."""
    phases = next((a.split("=", 1)[1] for a in argv if a.startswith("--phases=")), default).split(",")
    assert all(p in allowed for p in phases) and phases == sorted(set(phases), key=allowed.index), phases
    assert not set(apart) <= set(phases), f"{apart[1]} must not run with the {apart[0]} installed"
    return phases
