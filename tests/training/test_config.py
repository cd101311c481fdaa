"""validate_args refuses bad combinations and says why."""

from __future__ import annotations

import pytest

from training.config import Config, ConfigError, build_parser, parse_config, validate_args


def _ok_paths(tmp_path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    index = tmp_path / "idx"
    index.mkdir()
    return ["--model_path", str(model), "--train_data", str(rows), "--index", str(index)]


def test_defaults_parse_with_existing_paths(tmp_path):
    cfg = parse_config(_ok_paths(tmp_path))
    assert isinstance(cfg, Config)
    assert cfg.selfplay.solver_n == 4 and cfg.algorithm.solver_estimator == "grpo"


@pytest.mark.parametrize("extra, needle", [
    (["--proposer_estimator", "grpo", "--proposer_n", "1"], "group of one has no baseline"),
    (["--solver_estimator", "rloo", "--solver_n", "1"], "needs a group"),
    (["--solver_estimator", "gae"], "needs a critic"),
    (["--max_total_tokens", "9000", "--max_model_len", "4096"], "exceeds vLLM"),
    (["--micro_token_budget", "100"], "packing could not place"),
    (["--judge", "llm"], "needs --judge_url"),
    (["--rag_verify", "judge"], "--rag_verify judge needs --judge llm"),
    (["--dual_clip", "0.5"], "--dual_clip must be > 1"),
    (["--self_search_format_reward", "true"], "it needs --solver_search self"),
    (["--sim_noise_end", "1.5"], "are probabilities in [0, 1]"),
    (["--tis_cap", "2", "--temperature", "0.7"], "needs --temperature 1.0"),
    (["--old_logprobs", "rollout", "--temperature", "0.8"], "--old_logprobs rollout uses vLLM's raw"),
    (["--train_top_layers", "-1"], "--train_top_layers must be >= 0"),
    (["--max_failed_share", "1.5"], "--max_failed_share must be a share in [0, 1], got 1.5"),
    (["--max_nonfinite_steps", "0"], "--max_nonfinite_steps must be >= 1"),
    (["--min_searches", "3", "--max_turns", "3"], "--min_searches 3 needs --max_turns >= 4"),
    (["--ppo_epochs", "0"], "--ppo_epochs and --ppo_mini_batches must be >= 1"),
    (["--pool_init", "/nonexistent.jsonl"], "--pool_init /nonexistent.jsonl does not exist"),
])
def test_bad_combinations_are_refused_with_a_reason(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_ok_paths(tmp_path) + extra)
    assert needle in str(e.value)


def test_missing_paths_name_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_config(["--model_path", str(tmp_path / "nope"), "--train_data", str(tmp_path / "x.jsonl"),
                      "--index", str(tmp_path / "noidx")])
    msg = str(e.value)
    assert "prepare_data.py" in msg and "build_index.sh" in msg


def test_world_size_checks(tmp_path):
    cfg = parse_config(_ok_paths(tmp_path) + ["--prompts_per_step", "3", "--vllm_tp", "2"])
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, world_size=4)
    assert "multiple of the world size 4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, world_size=3)
    assert "--vllm_tp 2 must divide the world size 3" in str(e.value)


def test_every_flag_has_help():
    p = build_parser()
    for action in p._actions:
        if action.dest != "help":
            assert action.help, action.dest


@pytest.mark.parametrize("extra, needle", [
    (["--proposer_enable", "false", "--solver_enable", "false"], "no role would train"),
    (["--self_play_enable", "false", "--proposer_enable", "false"], "give them with --qa_data"),
    (["--self_play_enable", "false"], "no proposer to train"),
    (["--proposer_warm_up_steps", "3", "--proposer_enable", "false"], "--proposer_enable is false"),
    (["--qa_mix_fraction", "0.5"], "--qa_mix_fraction needs --qa_data"),
    (["--qa_mix_fraction", "1.0"], "must be in [0, 1)"),
])
def test_mode_contradictions_are_refused(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_ok_paths(tmp_path) + extra)
    assert needle in str(e.value)


def test_self_play_off_needs_no_proposer_rows(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "q?", "golden_answers": ["a"], "data_source": "x"}\n')
    args = _ok_paths(tmp_path) + ["--self_play_enable", "false", "--proposer_enable", "false", "--qa_data", str(qa),
                                  "--train_data", str(tmp_path / "missing.jsonl")]
    cfg = parse_config(args)
    assert not cfg.selfplay.self_play_enable


def test_help_lists_every_group_even_with_percent_signs_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser("ssp").parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "~30% more compute" in out and "--old_logprobs" in out


@pytest.mark.parametrize("rag, want", [("off", "4s(1-s)"), ("policy", "1-acc")])
def test_proposer_reward_auto_never_pays_unverified_questions_most(tmp_path, rag, want):
    """Without a RAG check, 1-acc would pay the most for a question no solver can answer because it
    is wrong; auto picks 4s(1-s) there, which pays 0 for it."""
    paths = _ok_paths(tmp_path)
    cfg = parse_config(paths + ["--rag_verify", rag])
    assert cfg.selfplay.proposer_reward == want
    from inference.rewards import proposer_reward
    if want == "4s(1-s)":
        assert proposer_reward([0.0] * 4, want) == 0.0 < proposer_reward([1.0, 0.0, 0.0, 1.0], want)
    # an explicit choice is kept (SSP's "without RAG verification" ablation stays possible)
    assert parse_config(paths + ["--rag_verify", rag, "--proposer_reward", "1-acc"]).selfplay.proposer_reward == "1-acc"


def test_search_counts_are_clamped_into_what_the_game_accepts():
    from inference.data import ProposerRow, clamp_search_turns
    rows = [ProposerRow(answer="a", search_turns=n, data_source="x", meta={}) for n in (1, 2, 3, 4, 5)]
    assert clamp_search_turns(rows, 2, 3) == 3
    assert [r.search_turns for r in rows] == [2, 2, 3, 3, 3]


def test_prepared_proposer_rows_ask_for_counts_the_default_game_accepts(tmp_path):
    import importlib.util
    import json
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("prepare_data", Path(__file__).resolve().parents[2] / "scripts/prepare_data.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    corpus = [{"id": str(i), "contents": f"Title{i}\ntext"} for i in range(300)]
    prep.build_proposer_rows(corpus, [], tmp_path / "rows.jsonl", 300, seed=0)
    counts = {json.loads(line)["search_turns"] for line in (tmp_path / "rows.jsonl").open()}
    sp, r = Config().selfplay, Config().rollout
    assert counts == set(range(sp.min_searches, r.max_turns)), counts   # {2, 3}: both ends drawn, nothing outside


def test_lr_follows_the_schedule_once_per_step_whatever_the_optimizer_steps():
    """set_lr against the schedule computed by hand: linear warm-up, then cosine to 0 at total_steps."""
    import math
    from types import SimpleNamespace

    from training.engine_builder import set_lr
    cfg = Config()
    o = cfg.optimisation
    o.lr, o.warmup_steps, o.total_steps, o.lr_schedule = 1e-3, 2, 10, "cosine"
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.0}, {"lr": 0.0}]))
    for step in range(10):
        want = 1e-3 * ((step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 8)))
        assert set_lr(engine, cfg, step) == pytest.approx(want)
        assert all(g["lr"] == pytest.approx(want) for g in engine.optimizer.param_groups)
