"""Fixtures of the training tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def torchrun_worker(tiny_model_dir, tmp_path):
    """run(worker, world, *extra, timeout=600) -> dict: tests/training/<worker>.py under torchrun at `world`
    ranks on the tiny model, one thread per rank; the dict is the JSON the worker writes to the path it is given."""
    from utils.dist import free_port

    def run(worker: str, world: int, *extra: str, timeout: int = 600) -> dict:
        out = tmp_path / f"{worker}_{world}{'_'.join(extra)}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
                   TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), str(REPO / "tests" / "training" / f"{worker}.py"), str(tiny_model_dir), str(out), *extra]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(out.read_text())

    return run
