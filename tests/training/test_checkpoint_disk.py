"""training/engine/memory_plan.py's checkpoint disk formula against the bytes a real save writes.

A torchrun worker (2 ranks over gloo, `__main__` below) builds the ZeRO-3 actor on the tiny model,
takes one optimizer step, and saves through training.engine.checkpoint.save with the HF export and a full
question pool; the test sorts the files of the checkpoint into the formula's terms:

    ZeRO-3 optimizer   *_optim_states.pt                12 B x trainable params (fp32 master + Adam m, v)
    frozen weights     zero_pp_rank_*_model_states.pt    b x frozen params (+ ~12 KB a rank)
    HF export          hf/                               b x params + tokenizer and config files
    trainer state      trainer_rank*.pt                  under the allowance per rank

Two settings cover both dtypes and both kinds of weight: bf16 with every weight trained, and fp32
with --train_top_layers 1 (most weights frozen: at fp32 too the optimizer file holds an fp32 master).
One launch saves both, one actor after the other (the 2-rank start-up, ~20 s of imports per rank, is
most of a launch's cost); each setting's files land in a folder of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]
KiB = 1024


def worker(out: Path, model: Path, settings: list[tuple[str, int]], pool_rows: int) -> None:
    """One ZeRO-3 actor per (dtype, top) setting, one after the other in this process: each takes one
    optimizer step and saves to out/run_<dtype>_<top>."""
    from utils.dist import prepare_launch_env

    prepare_launch_env()
    from utils import dist as D

    D.init_distributed()
    import torch

    from training.engine import checkpoint as C
    from training.settings.config import Config
    from training.engine.engine_builder import build_engines

    alive = []  # a collected engine tears down process groups DeepSpeed still caches (test_modes.py does the same)
    for dtype, top in settings:
        cfg = Config()
        cfg.model.model_path, cfg.model.dtype, cfg.model.gradient_checkpointing = str(model), dtype, False
        cfg.model.train_top_layers = top
        actor = build_engines(cfg).actor
        alive.append(actor)
        ids = (torch.arange(1, 49)[None] * 37) % 5000
        actor.backward(actor(input_ids=ids, labels=ids, use_cache=False).loss)
        actor.step()
        pool = [{"question": f"Which {i}th-century composer wrote the opera that premiered in the city where the "
                             f"river {i} meets the sea, and in which year did it first play there?",
                 "answer": [f"Composer {i}", f"C. {i}"], "step": i} for i in range(pool_rows)]
        C.save(actor, out / f"run_{dtype}_{top}", 1, {"cursor": 7, "qa_cursor": 0, "pool": pool, "ema_state": {}},
               tokenizer_dir=model, export=True, max_ckpts=2)
        D.barrier()
    import torch.distributed as dist
    dist.destroy_process_group()


SETTINGS = [("bf16", 0), ("fp32", 1)]
POOL_ROWS = 128  # each rank saves the same 128-question pool


@pytest.fixture(scope="module")
def saves(tmp_path_factory, tiny_model_dir) -> Path:
    """One 2-rank launch of worker(): a checkpoint per setting under out/run_<dtype>_<top>."""
    out = tmp_path_factory.mktemp("disk")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=str(REPO), TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).relative_to(REPO)), "disk", str(out), str(tiny_model_dir), json.dumps(SETTINGS),
           str(POOL_ROWS)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    for dtype, top in SETTINGS:
        assert (out / f"run_{dtype}_{top}" / "checkpoints" / "latest").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return out


def _bytes(files) -> int:
    return sum(p.stat().st_size for p in files if p.is_file())


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("dtype, top", SETTINGS)
def test_disk_formula_matches_a_real_save(saves, tiny_model_dir, dtype, top):
    from training.engine import memory_plan as mp
    from training.settings.config import Config

    world, pool_rows = 2, POOL_ROWS
    step = saves / f"run_{dtype}_{top}" / "checkpoints" / "step_000001"
    cfg = Config()
    cfg.model.model_path, cfg.model.dtype, cfg.model.train_top_layers = str(tiny_model_dir), dtype, top
    cfg.selfplay.pool_size = pool_rows
    d = mp.checkpoint_disk(cfg, world)
    counts = mp.count_params(mp.load_arch(str(tiny_model_dir))[0])
    b = 2 if dtype == "bf16" else 4
    p, pt = counts["total"], mp.trainable_params(counts, top)
    assert d["optimizer"] == 12 * pt and d["frozen_params"] == b * (p - pt) and d["module"] == 0
    assert (pt == p) == (top == 0)

    optim = _bytes(step.glob("*optim_states.pt"))
    states = _bytes(step.glob("*model_states.pt"))
    hf = _bytes((step / "hf").rglob("*"))
    trainer = _bytes(step.glob("trainer_rank*.pt"))
    whole = _bytes(step.rglob("*"))
    names = sorted(x.name for x in step.glob("*optim_states.pt"))
    want = [f"{'bf16_' if dtype == 'bf16' else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    assert names == want
    report = dict(dtype=dtype, top=top, params=p, trainable=pt, optim=optim, optim_formula=d["optimizer"],
                  states=states, frozen_formula=d["frozen_params"], hf=hf, hf_formula=d["hf_export"],
                  trainer=trainer, trainer_allowance=d["rank_states"], whole=whole, one_save=d["one_save"])
    print(json.dumps(report))
    # each term: within 0.1% plus a few KB of pickle/header per file
    assert abs(optim - d["optimizer"]) <= 0.001 * d["optimizer"] + world * 8 * KiB, report
    assert abs(states - d["frozen_params"]) <= 0.001 * d["frozen_params"] + world * 16 * KiB, report
    assert abs(hf - d["hf_export"]) <= 0.001 * d["hf_export"] + 16 * KiB, report
    assert d["hf_extras_source"] == "measured"
    assert trainer <= d["rank_states"], report       # the per-rank allowance holds a full pool
    # the whole save: never under the formula, and at most 2% over it (the per-rank allowance)
    assert whole <= d["one_save"] <= 1.02 * whole, report


def test_kept_saves_follow_save_every_and_max_ckpts():
    from training.engine import memory_plan as mp
    from training.settings.config import Config

    cfg = Config()
    cfg.model.model_path = "Qwen/Qwen2.5-7B-Instruct"
    o, ck = cfg.optimisation, cfg.checkpointing
    o.total_steps, ck.save_every, ck.max_ckpts = 200, 10, 3
    d = mp.checkpoint_disk(cfg, 8)
    assert d["saves_in_run"] == 20 and d["kept"] == 3 and d["kept_bytes"] == 3 * d["one_save"]
    assert d["during_save"] == 4                       # the newest is complete before the oldest goes
    o.total_steps, ck.save_every = 25, 10              # 10, 20 and the end (25)
    assert mp.checkpoint_disk(cfg, 8)["saves_in_run"] == 3
    ck.save_every = 0                                  # only at the end
    assert mp.checkpoint_disk(cfg, 8)["saves_in_run"] == 1
    ck.save_every, ck.max_ckpts = 10, 0                # 0 keeps every one (training.engine.checkpoint._rotate)
    d = mp.checkpoint_disk(cfg, 8)
    assert d["kept"] == d["saves_in_run"] == 3 and d["during_save"] == 3
    # Qwen2.5-7B at bf16, all trained: 12 B + 2 B (export) per parameter, the small terms aside
    p = d["optimizer"] // 12
    assert abs(d["one_save"] - 14 * p) < 0.01 * d["one_save"]
    ck.export_hf = False
    assert mp.checkpoint_disk(cfg, 8)["hf_export"] == 0


if __name__ == "__main__" and sys.argv[1:2] == ["disk"]:
    worker(Path(sys.argv[2]), Path(sys.argv[3]), [tuple(x) for x in json.loads(sys.argv[4])], int(sys.argv[5]))
