"""bench/bench_step.py: the step table read from constructed run folders (the critic's row and the shares), and
the launched command (its new flags parse and pass train.py's validate_args)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import bench.bench_step as bench_step  # noqa: E402
from training.settings.config import GROUPS, Config, build_parser, needs_critic, validate_args  # noqa: E402

# per step: sync, generate, logprobs, critic, update, step (first step = warm-up, dropped)
STEPS = [(9, 90, 9, 9, 9, 200), (1, 10, 2, 4, 3, 21), (1, 12, 2, 6, 3, 25)]


def _run_folder(path: Path, *, gae: bool, top: int) -> Path:
    path.mkdir(parents=True)
    cfg = Config()
    cfg.model.dtype, cfg.model.train_top_layers = "bf16", top
    if gae:
        cfg.algorithm.solver_estimator = cfg.algorithm.proposer_estimator = "gae"
    cfg.save(path / "config.json")
    with (path / "metrics.jsonl").open("w") as f:
        for i, (sync, gen, lp, critic, upd, step) in enumerate(STEPS):
            row = {"step": i + 1, "timing_s/sync": sync, "timing_s/generate": gen, "timing_s/logprobs": lp,
                   "timing_s/update": upd, "timing_s/step": step, "timing_s/search_solver": 0.5,
                   "rollout/solver_trajs": 4, "actor/num_tokens": 300}
            if gae:
                row["timing_s/critic"] = critic
            else:  # without the critic its time is simply not there; keep the step equal
                row["timing_s/step"] = step - critic
            f.write(json.dumps(row) + "\n")
    return path


def _bench(tmp_path, *runs: Path) -> tuple[str, dict]:
    out = tmp_path / "results"
    env = dict(os.environ, BENCH_RESULTS_DIR=str(out))
    subprocess.run([sys.executable, "bench/bench_step.py", "--run", *map(str, runs)], cwd=REPO, env=env, check=True,
                   capture_output=True, text=True)
    return (out / "RESULTS.md").read_text(), json.loads((out / "results.json").read_text())


def _row(md: str, name: str) -> list[str]:
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"| {name} |")]
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_critic_row_and_shares(tmp_path):
    md, keys = _bench(tmp_path, _run_folder(tmp_path / "gae", gae=True, top=8))
    assert "## step breakdown gae" in md and "bf16, top 8 layers, GAE critic: median s" in md
    # medians over steps 2 and 3: critic 5 of a 23 s step, update 3, other = step minus the named phases = 1
    assert _row(md, "critic (values + update)") == ["5", "22%"]
    assert _row(md, "update") == ["3", "13%"]
    assert _row(md, "other (advantages, metrics, ...)") == ["1", "4%"]
    assert _row(md, "step") == ["23", "100%"]
    assert "median over 2 steps (of 3)" in md
    assert keys["step.gae.top8.critic_s"] == 5 and keys["step.gae.top8.seconds"] == 23
    s = keys["_sections"]["step breakdown gae"]
    assert s["measures"] == sorted(bench_step.MEASURES) and s["script"] == "bench/bench_step.py"


def test_runs_side_by_side_keep_the_old_keys(tmp_path):
    md, keys = _bench(tmp_path, _run_folder(tmp_path / "full", gae=False, top=0),
                      _run_folder(tmp_path / "top8", gae=False, top=8))
    assert "## step breakdown\n" in md
    assert _row(md, "critic (values + update)") == ["0", "0%", "0", "0%"]   # no critic: 0 in both runs
    assert _row(md, "step") == ["18", "100%", "18", "100%"]
    assert keys["step.seconds"] == 18 and keys["step.top8.seconds"] == 18 and keys["step.update_s"] == 3


@pytest.mark.parametrize("estimator, top", [("", 0), ("gae", 8)])
def test_launch_command_carries_the_flags(tmp_path, estimator, top):
    cmd = bench_step.train_command(tmp_path / "out", 3, dtype="bf16", train_top_layers=top, estimator=estimator,
                                   port=12345)
    argv = cmd[cmd.index("train.py") + 1:]
    assert argv[argv.index("--dtype") + 1] == "bf16" and argv[argv.index("--train_top_layers") + 1] == str(top)
    # train.py's own parser and validate_args take it (paths swapped for ones that exist here)
    model, rows, index = tmp_path / "model", tmp_path / "rows.jsonl", tmp_path / "idx"
    model.mkdir()
    index.mkdir()
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    argv[argv.index("--index") + 1] = str(index)
    argv[argv.index("--pool_init") + 1] = str(rows)
    ns = build_parser().parse_args(argv + ["--model_path", str(model), "--train_data", str(rows)])
    cfg = Config(**{g: cls(**{f.name: getattr(ns, f.name) for f in fields(cls)}) for g, cls in GROUPS.items()})
    validate_args(cfg, world_size=2, cuda=False, multi_node=False)
    assert cfg.model.dtype == "bf16" and cfg.model.train_top_layers == top
    assert needs_critic(cfg) == (estimator == "gae")
    if estimator == "gae":
        assert cfg.algorithm.solver_estimator == cfg.algorithm.proposer_estimator == "gae"
        assert cfg.critic.critic_train_top_layers == top and cfg.critic.critic_gradient_checkpointing is False
