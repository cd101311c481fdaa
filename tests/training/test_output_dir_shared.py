"""--output_dir must be one folder for every rank (training.engine.run_folder.check_shared_output_dir).

Two ranks on one machine share every folder, so the test makes rank 1 look somewhere else with
the SSP_FAULT hook (SSP_FAULT=unshared_output_dir:1), as if its node had a disk of its own: both
ranks must stop with the same message, none may hang. The normal path (both ranks see the marker)
runs here too, and in every trainer test through prepare_output_dir.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]


def worker(out: Path, result: Path) -> None:
    """torchrun worker: a gloo group (no DeepSpeed needed) and prepare_output_dir, as the trainer
    calls it; writes its verdict to result.rank<r>.json."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from training.engine.run_folder import prepare_output_dir
    from training.settings.config import Config, ConfigError

    cfg = Config()
    cfg.logging.output_dir = str(out)
    try:
        verdict = {"ok": True, "run_id": prepare_output_dir(cfg)}
    except ConfigError as e:
        verdict = {"ok": False, "error": str(e)}
    Path(f"{result}.rank{dist.get_rank()}.json").write_text(json.dumps(verdict))
    dist.destroy_process_group()


def _launch(tmp_path: Path, name: str, **env) -> list[dict]:
    out, result = tmp_path / name, tmp_path / f"{name}.result"
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SSP_MARKER_WAIT_S="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).relative_to(REPO)), "worker", str(out), str(result)]
    r = subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(Path(f"{result}.rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.timeout(400)
def test_every_rank_stops_when_one_cannot_see_rank_0s_marker(tmp_path):
    ok = _launch(tmp_path, "shared")
    assert ok[0]["ok"] and ok[1]["ok"] and ok[0]["run_id"] == ok[1]["run_id"], ok
    assert len((tmp_path / "shared" / ".rank0_marker").read_text().strip()) == 32

    bad = _launch(tmp_path, "unshared", SSP_FAULT="unshared_output_dir:1")
    assert not bad[0]["ok"] and not bad[1]["ok"], bad
    assert bad[0]["error"] == bad[1]["error"]            # one decision, the same words on every rank
    msg = bad[0]["error"]
    want = (f"--output_dir {tmp_path / 'unshared'} is not shared between nodes: rank 1 on host "
            f"{socket.gethostname()} cannot see rank 0's marker")
    assert msg.startswith(want), msg
    assert "checkpoints and resume need a filesystem every node mounts (NFS, Lustre, ...)" in msg


def test_a_world_of_one_writes_no_marker(tmp_path):
    from training.engine.run_folder import check_shared_output_dir
    check_shared_output_dir(tmp_path / "solo")
    assert not (tmp_path / "solo").exists()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]), Path(sys.argv[3]))
