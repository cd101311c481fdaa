"""Training modes beyond full self-play, through train.py's flags: each runs 2 steps on CPU.

The modes run in TWO subprocesses side by side (each a world of 1 on one thread: tiny random model,
in-process vLLM), one trainer after another within each, so the start-up cost (~25 s of imports)
is paid twice and the second core of a 2-core box is not left idle. The modes whose metrics are
compared with each other (full and the self-distillation modes) share a process. For every mode
the test checks which roles played and which carried loss: an untrained role's trajectories must
carry none.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]

MODES = {
    "full": [],
    "self_play_off": ["--self_play_enable", "false", "--proposer_enable", "false"],
    "proposer_only": ["--solver_enable", "false"],
    "solver_only": ["--proposer_enable", "false"],
    "warm_up": ["--proposer_warm_up_steps", "1"],
    "mixed": ["--qa_mix_fraction", "0.5"],
    # search backends per role (issue: search without a search engine)
    "simulated": ["--proposer_search", "simulated", "--solver_search", "simulated", "--sim_noise_start", "0.0",
                  "--sim_noise_end", "1.0"],
    "self_search": ["--proposer_search", "self", "--solver_search", "self", "--self_search_format_reward", "true"],
    "retriever_proposer_self_solver": ["--proposer_search", "retriever", "--solver_search", "self"],
    # the learning proof's speed settings: top layer only, vLLM's log-probs as the ratio's old log-probs
    "top_layer_rollout_lp": ["--train_top_layers", "1", "--old_logprobs", "rollout", "--lr", "1e-3",
                             "--export_hf", "true", "--save_every", "2"],
    # two optimizer steps per SSP step: the LR must still follow the schedule per SSP step
    "sequential_warmup": ["--update_mode", "sequential", "--warmup_steps", "2", "--lr_schedule", "cosine",
                          "--lr", "1e-3"],
    # rollouts reused: 2 epochs x 2 mini-batches = 4 optimizer steps, the ratio leaves 1 after the first
    "ppo_epochs": ["--ppo_epochs", "2", "--ppo_mini_batches", "2", "--lr", "1e-3", "--entropy_coef", "0.05"],
    # bf16 weights in both engines: the rollout/actor gap is measured by a forward, not read off itself
    "bf16_rollout_lp": ["--dtype", "bf16", "--old_logprobs", "rollout", "--lr", "1e-3", "--entropy_coef", "0.05"],
    # DAPO's dynamic sampling without refill: a random tiny model answers nothing right, so every
    # solver group is flat (all 0) and none reaches the loss
    "drop_flat": ["--drop_flat_solver_groups", "true"],
    # a judge outage (nothing listens on --judge_url): every judging fails, so every solver group is
    # left out of the loss (half the groups here); tolerated (--max_failed_share 1), or stopped.
    # A random tiny model writes no <answer> (which needs no judge), so in these modes the driver
    # reads "x" as every solver's answer: each one then goes to the real LLM judge client.
    # self-distillation (issue 22): a random tiny model writes no valid question, so every solver question
    # is a pool fill without a construction path: --distill_hint gives each the golden answer as its teacher's
    # privileged context. Coefficient 0 must leave the update as "full"'s; 0.5 must change it.
    "distill_zero": ["--distill", "sampled", "--distill_coef", "0", "--distill_hint", "true",
                     "--distill_context_tokens", "128"],
    "distill_hint": ["--distill", "sampled", "--distill_coef", "0.5", "--distill_hint", "true", "--distill_context_tokens", "128",
                     "--distill_schedule", "linear", "--distill_coef_floor", "0.1"],
    # the frozen reference as the teacher: at step 1 it equals the policy, so its KL equals distill_zero's
    "distill_ref": ["--distill", "sampled", "--distill_coef", "0", "--distill_hint", "true",
                    "--distill_context_tokens", "128", "--distill_teacher", "reference"],
    # the top-K form: the teacher's top 8 tokens per position, the reverse KL in the loss (advantages as they
    # are; beta 0 == off is checked to 1e-6 in tests/training/test_distill_topk.py)
    "distill_topk": ["--distill", "topk", "--distill_topk", "8", "--distill_coef", "0.5", "--distill_hint", "true",
                     "--distill_context_tokens", "128"],
    "judge_down_tolerated": ["--judge", "llm", "--judge_url", "{dead_url}", "--judge_model", "m",
                             "--max_failed_share", "1.0"],
    "judge_down": ["--judge", "llm", "--judge_url", "{dead_url}", "--judge_model", "m", "--max_failed_share", "0.25"],
}
STOPS = {"judge_down"}  # modes that must stop with a RuntimeError (recorded in error.txt)
# The second process's modes (the rest run in the first, with "full" and every mode compared with it).
SECOND = ("self_play_off", "proposer_only", "solver_only", "simulated", "self_search", "retriever_proposer_self_solver",
          "sequential_warmup", "ppo_epochs", "bf16_rollout_lp")

DRIVER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    from training.settings.config import parse_config
    from training.loop.trainer import SSPTrainer
    modes, common, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    import inference.pipeline as G  # judge_item extracts the solvers' answers for both schedules
    extract = G.extract_answer
    alive = []  # a collected vLLM engine tears down process groups DeepSpeed still caches
    for name, extra in modes.items():
        t0 = time.process_time()  # each mode's CPU seconds go to the log: what SECOND balances
        G.extract_answer = (lambda text: "x") if name.startswith("judge_down") else extract
        cfg = parse_config(common + extra + ["--output_dir", f"{{out}}/{{name}}"])
        alive.append(SSPTrainer(cfg))
        try:
            alive[-1].run()
        except RuntimeError as e:  # a guard stopped the run: recorded for the test to judge
            open(f"{{out}}/{{name}}/error.txt", "w").write(str(e))
        if name == "simulated":  # a random tiny model rarely searches: ask the trainer's own backend
            alive[-1].hybrid.to_generate()  # the run ends in train mode, where vLLM sleeps (SSP_EMULATE_GPU_SLEEP)
            s = alive[-1].search["solver"]
            docs = s.search(["capital of France", "largest river in Europe"], 2,
                            contexts=[{{"question": "What is the capital of France?", "answer": ["Paris"]}}] * 2)
            json.dump({{"docs": [len(d) for d in docs], "failures": s.failures, "stats": s.backend.stats}},
                      open(f"{{out}}/{{name}}/direct_search.json", "w"))
        print(f"mode {{name}}: {{time.process_time() - t0:.1f}} s CPU", flush=True)
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, bm25_corpus):
    d = tmp_path_factory.mktemp("modes")
    corpus = [json.loads(line) for line in (bm25_corpus / "corpus.jsonl").open()]
    titles = [c["contents"].split("\n")[0] for c in corpus]
    (d / "rows.jsonl").write_text("".join(json.dumps({"answer": t, "search_turns": 2}) + "\n" for t in titles[:8]))
    (d / "qa.jsonl").write_text("".join(json.dumps({"question": f"Which article is titled {t}?", "golden_answers": [t],
                                                     "data_source": "synthetic"}) + "\n" for t in titles[8:16]))
    common = ["--model_path", str(tiny_model_dir), "--dtype", "fp32", "--gradient_checkpointing", "false",
              "--train_data", str(d / "rows.jsonl"), "--qa_data", str(d / "qa.jsonl"), "--pool_init", str(d / "qa.jsonl"),
              "--index", str(bm25_corpus / "bm25"), "--prompts_per_step", "2", "--solver_n", "2", "--total_steps", "2",
              "--max_turns", "2", "--min_searches", "1", "--max_tokens_per_turn", "16", "--max_total_tokens", "512",
              "--max_model_len", "1024",
              "--micro_token_budget", "1024", "--save_every", "0", "--export_hf", "false", "--tensorboard", "false",
              "--sample_every", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", SSP_EMULATE_GPU_SLEEP="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    (d / "driver.py").write_text(DRIVER.format(repo=str(REPO)))
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    modes = {k: [a.replace("{dead_url}", dead_url) for a in v] for k, v in MODES.items()}
    groups = [{k: v for k, v in modes.items() if k not in SECOND}, {k: v for k, v in modes.items() if k in SECOND}]
    procs = []
    try:
        for i, group in enumerate(groups):
            with (d / f"driver{i}.log").open("w") as log:
                procs.append(subprocess.Popen([sys.executable, str(d / "driver.py"), json.dumps(group), json.dumps(common),
                                               str(d / "out")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=900) == 0, (d / f"driver{i}.log").read_text()[-8000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {name: [json.loads(line) for line in (d / "out" / name / "metrics.jsonl").open()]
            for name in MODES if (d / "out" / name / "metrics.jsonl").exists()}
    runs["_direct_search"] = json.loads((d / "out" / "simulated" / "direct_search.json").read_text())
    runs["_errors"] = {name: (d / "out" / name / "error.txt").read_text()
                       for name in MODES if (d / "out" / name / "error.txt").exists()}
    runs["_dirs"] = {"out": d / "out", "tiny": tiny_model_dir}
    yield runs
    shutil.rmtree(d, ignore_errors=True)  # ~1.4 GB of checkpoints: freed when the module ends, not the session


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_each_mode_trains_only_its_roles(runs):
    assert set(runs["_errors"]) == STOPS, runs["_errors"]
    for name, steps in ((k, v) for k, v in runs.items() if k in MODES and k not in STOPS):
        assert [m["step"] for m in steps] == [1, 2], name
    played = lambda m, role: m.get(f"rollout/{role}_trajs", 0) > 0  # noqa: E731
    tokens = lambda m, role: m[f"train/{role}_tokens"]  # noqa: E731

    for m in runs["full"]:
        assert played(m, "proposer") and played(m, "solver")
        assert tokens(m, "proposer") > 0 and tokens(m, "solver") > 0
        assert m["actor/num_tokens"] == tokens(m, "proposer") + tokens(m, "solver")
    for m in runs["self_play_off"]:   # Search-R1-style: QA questions only, no proposer at all
        assert not played(m, "proposer") and played(m, "solver")
        assert tokens(m, "proposer") == 0 and tokens(m, "solver") > 0
        assert m["game/questions"] == 2
    for m in runs["proposer_only"]:   # the solver plays (to score questions) but carries no loss
        assert played(m, "solver") and tokens(m, "solver") == 0 and tokens(m, "proposer") > 0
        assert m["actor/num_tokens"] == tokens(m, "proposer")
    for m in runs["solver_only"]:
        assert played(m, "proposer") and tokens(m, "proposer") == 0 and tokens(m, "solver") > 0
        assert m["actor/num_tokens"] == tokens(m, "solver")
    first, second = runs["warm_up"]   # step 1: proposer only; step 2: both
    assert tokens(first, "solver") == 0 and tokens(first, "proposer") > 0 and played(first, "solver")
    assert tokens(second, "solver") > 0 and tokens(second, "proposer") > 0
    for m in runs["mixed"]:           # 2 prompts: one proposer row, one fixed QA question
        assert m["game/proposer_trajs"] == 1
        assert played(m, "solver") and tokens(m, "solver") > 0
    # simulated search: the curriculum moves from 0 to 1 over the 2 steps with base 4: p(0)=0, p(1)=1/3
    sim = runs["simulated"]
    assert sim[0]["search/sim_noise_p"] == pytest.approx(0.0) and sim[1]["search/sim_noise_p"] == pytest.approx(1 / 3)
    for name in ("simulated", "self_search", "retriever_proposer_self_solver"):
        for m in runs[name]:
            assert played(m, "proposer") and played(m, "solver") and tokens(m, "solver") > 0, name
    # the simulator on the policy's own engine (the trainer's wiring, after two steps of weight
    # syncs) writes documents (issue 14 (8): on a shared engine it once returned none)
    for m in sim:
        assert m["search/sim_failures"] == 0 and m["game/excluded/search_failed"] == 0, m
        # a step whose rollouts searched got documents back from the simulator (never an empty answer)
        assert m.get("search/queries", 0) == 0 or m["search/sim_docs"] > 0, m
    direct = runs["_direct_search"]
    assert direct["failures"] == 0 and direct["stats"]["failures"] == 0, direct
    assert direct["docs"] == [2, 2] and direct["stats"]["docs"] >= 4, direct
    # SSRL shaping reached the rewards the loss sees: 0.9 * correct + 0.1 * format, per trajectory
    # (a spammed answer's share divided by 4, so only below that when some solver spammed)
    for m in runs["self_search"]:
        unspammed = 0.9 * m["train/solver_correct_mean"] + 0.1 * m["search/self_format_reward"]
        if m.get("solver/spam_rate", 0.0) == 0:
            assert m["train/solver_reward_mean"] == pytest.approx(unspammed, abs=1e-6), m
        else:
            assert m["train/solver_reward_mean"] <= unspammed + 1e-6, m


@pytest.mark.slow
def test_flat_solver_groups_are_dropped_on_request(runs):
    for m in runs["drop_flat"]:
        assert m["solver/acc"] == 0 and m["game/flat_solver_groups"] == m["game/questions"] > 0, m
        assert m["train/solver_tokens"] == 0 and m["actor/num_tokens"] == m["train/proposer_tokens"] > 0, m
    assert all(m["train/solver_tokens"] > 0 for m in runs["full"])   # the same game without the flag


@pytest.mark.slow
def test_failed_judging_is_left_out_and_stops_the_run(runs):
    """A judge outage: every judging fails, so every solver group is left out of the loss (the
    proposers, whose questions were invalid and scored the format penalty without the judge, still
    train), and past --max_failed_share the run stops at its first step with a message that says
    why. Before, a failed judging counted as "wrong" and the solver trained on it."""
    for m in runs["judge_down_tolerated"]:
        assert m["solver/judge_failed"] > 0 and m["game/excluded/judge_failed"] == m["game/excluded_groups"] > 0, m
        assert m["game/excluded_groups"] == m["game/groups"] - m["game/proposer_trajs"], m  # all solver groups
        assert m["train/solver_tokens"] == 0 and m["actor/num_tokens"] == m["train/proposer_tokens"] > 0, m
    assert runs.get("judge_down", []) == []            # stopped before any step was logged
    err = runs["_errors"]["judge_down"]
    assert "left out of the loss" in err and "--max_failed_share" in err and "judge_failed" in err, err


@pytest.mark.slow
def test_top_layers_train_alone_and_rollout_logprobs_serve_as_old(runs):
    """--train_top_layers 1: only the last decoder layer (and the final norm) moved; embeddings and
    layer 0 are bit-identical to the start. --old_logprobs rollout: the first-pass ratio is vLLM vs
    the actor, i.e. 1 up to the engines' fp32 gap."""
    from safetensors.torch import load_file
    start = load_file(str(runs["_dirs"]["tiny"] / "model.safetensors"))
    end = load_file(str(runs["_dirs"]["out"] / "top_layer_rollout_lp" / "checkpoints" / "step_000002" / "hf" / "model.safetensors"))
    for name, w in start.items():
        if not (name.startswith("model.layers.1.") or name == "model.norm.weight"):
            assert torch.equal(w, end[name]), f"frozen weight {name} changed"
    # (whether layer 1 moved depends on a non-zero advantage, which a random tiny model rarely earns;
    # the point here is that frozen weights stay bit-identical and the ratio starts at 1)
    for m in runs["top_layer_rollout_lp"]:
        assert m["train/solver_tokens"] > 0
        assert abs(m["actor/ratio_mean"] - 1) < 1e-3 and m["actor/rollout_lp_gap"] < 1e-3


@pytest.mark.slow
def test_lr_schedule_optimizer_steps_and_measured_gaps(runs):
    # sequential: 2 optimizer steps per SSP step (proposer, solver); the LR is that of the SSP step,
    # by hand: warm-up (step + 1) / 2 -> 0.5e-3, 1e-3 (a scheduler stepped per optimizer step ran 2x fast)
    seq = runs["sequential_warmup"]
    assert [m["actor/lr"] for m in seq] == pytest.approx([0.5e-3, 1e-3])
    assert [m["actor/optimizer_steps"] for m in seq] == [2, 2]
    assert [m["actor/lr"] for m in runs["full"]] == pytest.approx([1e-6, 1e-6])
    # PPO epochs x mini-batches: 4 optimizer steps; from the second on the ratio is no longer 1
    for m in runs["ppo_epochs"]:
        assert m["actor/optimizer_steps"] == 4
        assert max(m["actor/ratio_max"] - 1, 1 - m["actor/ratio_min"]) > 1e-4, m
        assert m["actor/weights_changed_frac"] > 0.1
    # fp32: vLLM's log-probs equal the actor's right after the sync; the gap is measured, not 0 by construction
    for m in runs["top_layer_rollout_lp"] + runs["full"]:
        assert 0 < m["actor/rollout_lp_gap"] < 1e-3, m["actor/rollout_lp_gap"]
    # bf16: both engines round differently, but the sync must still land (a stale or garbled sync
    # gives gaps of order 1: 1.45 for a missed tied lm_head, docs/PLATFORM_NOTES.md, vLLM tied embeddings)
    for m in runs["bf16_rollout_lp"]:
        assert 0 < m["actor/rollout_lp_gap"] < 0.1, m["actor/rollout_lp_gap"]
        assert 0 < m["actor/weights_changed_frac"] <= 1


@pytest.mark.slow
def test_self_distillation_adds_the_teachers_term_and_zero_changes_nothing(runs):
    full, zero, hint = runs["full"], runs["distill_zero"], runs["distill_hint"]
    for m in zero + hint:
        assert m["distill/coverage"] == 1.0 and m["distill/with_teacher"] == m["rollout/solver_trajs"] > 0, m
        assert m["timing_s/teacher"] > 0 and abs(m["distill/kl"] + m["distill/logp_gap"]) < 1e-9, m
        assert 0 < abs(m["distill/kl"]) < 50, m      # the hint changes the scores of the sampled tokens
    assert [m["distill/beta"] for m in hint] == pytest.approx([0.5, 0.3])   # linear from 0.5 to 0.1 over 2 steps
    for a, b in zip(full, zero):   # same seed, same games (the precondition), so the same update at beta 0
        assert (a["train/solver_tokens"], a["solver/acc"]) == (b["train/solver_tokens"], b["solver/acc"])
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-6)
    assert any(abs(a["actor/pg_loss"] - b["actor/pg_loss"]) > 1e-4 for a, b in zip(full, hint)
               if a["train/solver_tokens"] == b["train/solver_tokens"])
    ref = runs["distill_ref"]   # the reference teacher ran (it is built only for it: --kl_coef is 0)
    assert all(m["distill/coverage"] == 1.0 and m["timing_s/teacher"] > 0 for m in ref)
    assert ref[0]["distill/kl"] == pytest.approx(zero[0]["distill/kl"], abs=1e-5)


@pytest.mark.slow
def test_topk_self_distillation_reports_its_kl_and_leaves_the_advantages(runs):
    full, topk = runs["full"], runs["distill_topk"]
    for m in topk:
        assert m["distill/coverage"] == 1.0 and m["distill/with_teacher"] == m["rollout/solver_trajs"] > 0, m
        assert m["timing_s/teacher"] > 0 and "distill/logp_gap" not in m, m   # the kl is the update's top-K KL
        assert math.isfinite(m["distill/kl"]) and 0 < m["distill/kl"] < 50, m
        assert m["distill/beta"] == 0.5 and m["distill/kl_loss"] > 0, m
    a, b = full[0], topk[0]   # step 1: same seed, same games, same weights
    assert (a["train/solver_tokens"], a["solver/acc"]) == (b["train/solver_tokens"], b["solver/acc"])
    assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-6)   # the advantages are left as they are
    assert b["actor/grad_norm"] != a["actor/grad_norm"]                         # the term is in the gradient


def test_drop_flat_solver_groups_keeps_groups_with_a_signal():
    from types import SimpleNamespace as T

    from training.loop.rounds import drop_flat_solver_groups
    trajs = [T(role="solver", group_id="a", reward=r) for r in (1.0, 0.0)]      # mixed: kept
    trajs += [T(role="solver", group_id="b", reward=r) for r in (1.0, 1.0)]     # all right: dropped
    trajs += [T(role="solver", group_id="c", reward=r) for r in (0.0, 0.0)]     # all wrong: dropped
    trajs += [T(role="proposer", group_id="b", reward=0.5)]                     # proposers are never dropped
    kept, n_flat = drop_flat_solver_groups(trajs)
    assert n_flat == 2 and [(t.role, t.group_id) for t in kept] == [("solver", "a"), ("solver", "a"), ("proposer", "b")]


def test_self_search_shaping_rewrites_the_solver_rewards_the_loss_reads():
    """The trainer's SSRL shaping sets each solver trajectory's reward to 0.9 * correct + 0.1 * format
    (a well-formed wrong answer earns 0.1, a malformed right one 0.9); proposer rewards are left alone."""
    from inference.self_search import shape_solver_rewards
    from inference.trajectory import Outcome, Trajectory

    good = "<think>look it up</think><search>capital of France</search><information>Paris is the capital." \
           "</information><think>so</think><answer>Paris</answer>"
    def traj(role, text, correct, reward):  # noqa: E306
        return Trajectory(role, "g", [1, 2], [0, 1], [0.0, -0.5], prompt_len=1, question="q", answer="Paris",
                          response_text=text, reward=reward, outcome=Outcome(correct=correct))
    trajs = [traj("solver", good, 0.0, 0.0), traj("solver", "Paris", 1.0, 1.0), traj("solver", good, 1.0, 1.0),
             traj("proposer", good, 0.0, -1.0)]
    shape_solver_rewards(trajs)
    assert [t.reward for t in trajs] == pytest.approx([0.1, 0.9, 1.0, -1.0])
    assert [t.outcome.format_reward for t in trajs] == [1.0, 0.0, 1.0, None]


def test_self_search_shaping_keeps_the_spam_penalty():
    """game.score divides a spammed answer's reward by GameConfig.spam_divisor (recorded as
    outcome.spam); the SSRL shaping that replaces the reward must keep that division: a spammed
    right answer earns (0.9 + 0.1 * format) / 4, not 0.9."""
    from inference.game import GameConfig
    from inference.rewards import is_answer_spam
    from inference.self_search import shape_solver_rewards
    from inference.trajectory import Outcome, Trajectory

    clean = "<think>so</think><answer>Paris</answer>"
    spammed = "<think>so</think><answer><answer>Paris</answer>"
    assert is_answer_spam(spammed) and not is_answer_spam(clean)
    def traj(text, correct):  # noqa: E306  (the outcome as inference.game.score writes it)
        return Trajectory("solver", "g", [1, 2], [0, 1], [0.0, -0.5], prompt_len=1, question="q", answer="Paris",
                          response_text=text, reward=1.0, outcome=Outcome(correct=correct, spam=is_answer_spam(text)))
    trajs = [traj(spammed, 1.0), traj(clean, 1.0), traj(spammed, 0.0)]
    shape_solver_rewards(trajs)
    fmt = [t.outcome.format_reward for t in trajs]
    assert fmt == [0.0, 1.0, 0.0]
    assert GameConfig.spam_divisor == 4.0
    assert [t.reward for t in trajs] == pytest.approx([0.9 / 4, 1.0, 0.0])
    trajs = [traj(spammed, 1.0)]
    shape_solver_rewards(trajs, spam_divisor=2.0)     # the run's GameConfig divisor is honoured
    assert trajs[0].reward == pytest.approx(0.9 / 2)
