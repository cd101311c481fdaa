"""Positive control: the whole trainer learns a reward it can earn.

A tiny random model is first taught (training/loop/sft.py, the real cold-start path) to answer a
question with "Paris" or "Rome", about half and half. Then train.py runs Search-R1-style RL
(self-play off, no search) on questions whose only golden answer is "Paris": a rigged,
deterministic reward (exact match) that pays one fixed answer. Against the same run at lr = 0:
  * the reward rises and ends above the control's,
  * the log-prob of answering "Paris" rises and that of "Rome" falls,
  * with --train_top_layers 1 the top layer moved and the layers below are bit-identical.
The rollouts are sampled by vLLM after each weight sync, so this goes through every part of a
step: sync, generation, reward, advantages, the packed update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
QUESTIONS = [f"Which city is the capital of France? (form {i})" for i in range(8)]


def _demo(q: str, city: str) -> dict:
    return {"role": "solver", "question": q, "turns": [{"kind": "model", "text": f"<answer>{city}</answer>"}]}


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu",
                VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))


def _run(cmd: list[str], log: Path) -> None:
    _wait(_start(cmd, log), log)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path) -> None:
    try:
        rc = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    assert rc == 0, log.read_text()[-4000:]


def _answer_logprob(model_dir: Path, city: str) -> float:
    """Mean over the questions of log p(<answer>city</answer> | solver prompt), in plain HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.loop.sft import render_demo
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for q in QUESTIONS:
        ids, mask = render_demo(tok, _demo(q, city))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        total += float((lp * torch.tensor(mask[1:], dtype=torch.float32)).sum())
    return total / len(QUESTIONS)


def _weights(d: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rl_raises_a_rigged_reward_against_an_lr0_control(tiny_model_dir, tmp_path):
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(_demo(q, c)) + "\n" for q in QUESTIONS for c in ("Paris", "Rome")))
    _run(["-m", "training.loop.sft", "--data", str(demos), "--model_path", str(tiny_model_dir),
          "--output_dir", str(tmp_path / "sft"), "--dtype", "fp32", "--batch_size", "16", "--epochs", "40",
          "--lr", "3e-3", "--warmup_steps", "0", "--lr_schedule", "constant", "--gradient_checkpointing", "false",
          "--tensorboard", "false"], tmp_path / "sft.log")
    start = tmp_path / "sft" / "hf"
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "golden_answers": ["Paris"], "data_source": "rigged"}) + "\n"
                          for q in QUESTIONS))
    common = ["train.py", "--model_path", str(start), "--dtype", "fp32", "--gradient_checkpointing", "false",
              "--self_play_enable", "false", "--proposer_enable", "false", "--qa_data", str(qa),
              "--proposer_search", "none", "--solver_search", "none", "--prompts_per_step", "2", "--solver_n", "8",
              "--max_turns", "1", "--max_tokens_per_turn", "16", "--max_total_tokens", "256", "--max_model_len", "512",
              "--micro_token_budget", "512", "--total_steps", str(STEPS), "--train_top_layers", "1",
              "--save_every", "0", "--tensorboard", "false", "--sample_every", "0"]
    # The run and its control are independent one-rank processes (one thread each): run side by side, on 2 cores
    # they take the time of one.
    procs = {name: _start(common + ["--lr", lr, "--output_dir", str(tmp_path / name)], tmp_path / f"{name}.log")
             for name, lr in (("rl", "2e-3"), ("control", "0"))}
    try:
        for name, proc in procs.items():
            _wait(proc, tmp_path / f"{name}.log")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()] for name in procs}
    acc = {k: [m["solver/acc"] for m in v] for k, v in runs.items()}
    # the same seeds: step 1 samples the same answers from the same weights in both runs
    assert acc["rl"][0] == acc["control"][0]
    assert 0.1 < acc["control"][0] < 0.9, acc          # the SFT start answers Paris only some of the time
    late = {k: sum(v[-4:]) / 4 for k, v in acc.items()}   # measured: rl 0.80, control 0.55
    assert late["rl"] > late["control"] + 0.15 and late["rl"] > acc["rl"][0] + 0.15, acc

    end = {k: tmp_path / k / "checkpoints" / f"step_{STEPS:06d}" / "hf" for k in runs}
    lp = {k: (_answer_logprob(d, "Paris"), _answer_logprob(d, "Rome")) for k, d in {"start": start, **end}.items()}
    assert lp["control"] == pytest.approx(lp["start"], abs=1e-4), lp
    assert lp["rl"][0] > lp["start"][0] + 0.1 and lp["rl"][1] < lp["start"][1] - 0.1, lp

    w0, w1 = _weights(start), _weights(end["rl"])
    top = [k for k in w0 if k.startswith("model.layers.1.")]
    assert top and any(not torch.equal(w0[k], w1[k]) for k in top)
    for k in w0:
        if not (k.startswith("model.layers.1.") or k == "model.norm.weight"):
            assert torch.equal(w0[k], w1[k]), f"frozen weight {k} moved"
    print("solver/acc by step:", acc, "log-probs (Paris, Rome):", lp)
