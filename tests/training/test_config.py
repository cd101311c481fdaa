"""validate_args refuses bad combinations and says why."""

from __future__ import annotations

import pytest

from training.settings.config import Config, ConfigError, build_parser, parse_config, validate_args


def _ok_paths(tmp_path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    index = tmp_path / "idx"
    index.mkdir(exist_ok=True)
    return ["--model_path", str(model), "--train_data", str(rows), "--index", str(index)]


def test_defaults_parse_with_existing_paths(tmp_path):
    cfg = parse_config(_ok_paths(tmp_path))
    assert isinstance(cfg, Config)
    assert cfg.selfplay.solver_n == 5 and cfg.algorithm.solver_estimator == "grpo"


@pytest.mark.parametrize("extra, needle", [
    (["--proposer_estimator", "grpo", "--proposer_n", "1"], "group of one has no baseline"),
    (["--solver_estimator", "rloo", "--solver_n", "1"], "needs a group"),
    (["--solver_estimator", "gae", "--kl_in_reward", "0.01", "--kl_coef", "0.01"], "so it would be paid twice"),
    (["--kl_in_reward", "0.01"], "no role uses --*_estimator gae"),
    (["--critic_warmup", "2"], "so there is no critic"),
    (["--solver_estimator", "gae", "--gae_lambda", "1.5"], "--gae_gamma and --gae_lambda must be in [0, 1]"),
    (["--solver_estimator", "gae", "--value_clip", "-1"], "--value_clip and --critic_lr must be >= 0"),
    (["--solver_estimator", "gae", "--critic_model_path", "/nonexistent/critic"],
     "--critic_model_path /nonexistent/critic does not exist"),
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
    (["--pool_min_solve_rate", "0.6", "--pool_max_solve_rate", "0.5"], "they must satisfy 0 <= min <= max <= 1"),
    (["--pool_max_solve_rate", "1.5"], "they must satisfy 0 <= min <= max <= 1"),
    (["--pool_clear_every", "-1"], "--pool_clear_every must be >= 0 (0 = never)"),
    (["--distill", "sampled", "--distill_coef", "0.1", "--distill_coef_floor", "0.2"], "must satisfy 0 <= floor <= coef"),
    (["--distill", "sampled", "--solver_enable", "false"], "it needs --solver_enable true"),
    (["--distill", "sampled", "--distill_context_tokens", "0"], "--distill_context_tokens must be >= 1"),
    (["--distill", "topk", "--distill_topk", "0"], "--distill_topk must be >= 1 (the teacher's top-K tokens per position), got 0"),
    (["--distill", "topk", "--solver_enable", "false"], "--distill topk trains the solver toward a teacher"),
    (["--distill", "topk", "--micro_token_budget", "4096", "--max_total_tokens", "4000", "--max_model_len", "4096"],
     "cannot hold a teacher sequence"),
    (["--distill", "sampled", "--micro_token_budget", "4096", "--max_total_tokens", "4000", "--max_model_len", "4096"],
     "cannot hold a teacher sequence"),
    (["--distill", "contrast", "--self_play_enable", "false", "--proposer_enable", "false", "--qa_data", "/x.jsonl"],
     "fixed QA rows have none: it needs --self_play_enable true"),
    (["--distill", "contrast", "--self_play_enable", "false", "--proposer_enable", "false", "--distill_hint", "true"],
     "fixed QA rows have none: it needs --self_play_enable true"),
    (["--distill", "contrast", "--solver_enable", "false"], "--distill contrast trains the solver toward a teacher"),
    (["--distill", "contrast", "--micro_token_budget", "4096", "--max_total_tokens", "4000", "--max_model_len", "4096"],
     "cannot hold a teacher sequence"),
    # dynamic sampling with refill, and the search-count mix
    (["--min_informative_groups", "-1"], "--min_informative_groups must be >= 0 (0 = off) and --max_rounds >= 1"),
    (["--max_rounds", "0"], "--min_informative_groups must be >= 0 (0 = off) and --max_rounds >= 1 (got 0, 0)"),
    (["--min_informative_groups", "4", "--max_rounds", "1", "--drop_flat_solver_groups", "true"],
     "but --max_rounds 1 allows none"),
    (["--min_informative_groups", "4"], "add --drop_flat_solver_groups true"),
    (["--min_informative_groups", "4", "--drop_flat_solver_groups", "true", "--solver_enable", "false"],
     "which carry no loss with --solver_enable false"),
    (["--search_turns_mix", "4:x"], "--search_turns_mix '4:x': expected weights of n = 1, 2, ..."),
    (["--search_turns_mix", "0:0"], "weights must be finite, >= 0 and not all 0"),
])
def test_bad_combinations_are_refused_with_a_reason(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_ok_paths(tmp_path) + extra)
    assert needle in str(e.value)


def test_gae_is_accepted_with_a_critic_per_role(tmp_path):
    from training.settings.config import needs_critic, needs_reference

    assert not needs_critic(parse_config(_ok_paths(tmp_path)))
    cfg = parse_config(_ok_paths(tmp_path) + ["--solver_estimator", "gae", "--proposer_estimator", "reinforce++",
                                              "--solver_n", "1", "--critic_warmup", "2"])
    assert needs_critic(cfg) and cfg.critic.gae_gamma == 1.0 and cfg.critic.gae_lambda == 1.0
    kl = parse_config(_ok_paths(tmp_path) + ["--proposer_estimator", "gae", "--kl_in_reward", "0.05"])
    assert needs_critic(kl) and needs_reference(kl)          # the KL in the reward needs the reference


def test_the_reference_is_built_for_kl_or_as_the_teacher(tmp_path):
    from training.settings.config import needs_reference

    assert not needs_reference(parse_config(_ok_paths(tmp_path)))
    assert needs_reference(parse_config(_ok_paths(tmp_path) + ["--kl_coef", "0.01"]))
    assert not needs_reference(parse_config(_ok_paths(tmp_path) + ["--distill", "sampled"]))   # the policy teaches
    assert needs_reference(parse_config(_ok_paths(tmp_path) + ["--distill", "sampled", "--distill_teacher", "reference"]))
    assert not needs_reference(parse_config(_ok_paths(tmp_path) + ["--distill_teacher", "reference"]))  # distill off
    assert needs_reference(parse_config(_ok_paths(tmp_path) + ["--distill", "topk", "--distill_teacher", "reference"]))


def test_distill_topk_is_accepted_with_its_k(tmp_path):
    a = parse_config(_ok_paths(tmp_path) + ["--distill", "topk", "--distill_topk", "32"]).distill
    assert (a.distill, a.distill_topk) == ("topk", 32)
    assert parse_config(_ok_paths(tmp_path)).distill.distill_topk == 16


def test_distill_contrast_is_accepted_with_self_play(tmp_path):
    from training.settings.config import needs_reference

    cfg = parse_config(_ok_paths(tmp_path) + ["--distill", "contrast", "--distill_coef", "0.2", "--distill_schedule",
                                              "cosine", "--distill_hint", "true"])
    a = cfg.distill
    assert (a.distill, a.distill_coef, a.distill_schedule) == ("contrast", 0.2, "cosine") and not needs_reference(cfg)
    assert needs_reference(parse_config(_ok_paths(tmp_path) + ["--distill", "contrast", "--distill_teacher", "reference"]))


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
    assert "--prompts_per_step 3 must be a multiple of the data-parallel size 2 (world size 4 / --vllm_tp 2)" in str(e.value)
    assert "e.g. 2 or 4, or 0 for auto" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, world_size=3)
    assert "--vllm_tp 2 must divide the world size 3" in str(e.value)
    # the data-parallel size is what counts: a TP group shares its prompts (trainer.next_batch)
    cfg = parse_config(_ok_paths(tmp_path) + ["--prompts_per_step", "4", "--vllm_tp", "4"])
    validate_args(cfg, world_size=16)
    with pytest.raises(ConfigError, match="multiple of the data-parallel size 8"):
        validate_args(cfg, world_size=32)


# ----------------------------------------------------------------------------- --prompts_per_step auto

@pytest.mark.parametrize("world, tp, want", [(1, 1, 4), (2, 1, 8), (8, 1, 32), (8, 4, 8), (16, 2, 32), (8, 8, 4)])
def test_prompts_per_step_auto_is_4_per_data_parallel_group(tmp_path, world, tp, want):
    """The default (0 = auto) runs at every world size; the value written to config.json is the
    resolved one. An explicit value is kept as it is."""
    from training.settings.config import resolve_defaults
    cfg = parse_config(_ok_paths(tmp_path) + ["--vllm_tp", str(tp)])
    assert cfg.selfplay.prompts_per_step == 0          # unknown world at parse time: still auto
    resolve_defaults(cfg, world_size=world)
    assert cfg.selfplay.prompts_per_step == want
    validate_args(cfg, world_size=world)
    explicit = parse_config(_ok_paths(tmp_path) + ["--vllm_tp", str(tp), "--prompts_per_step", "64"])
    assert resolve_defaults(explicit, world_size=world).selfplay.prompts_per_step == 64


def test_the_readme_gpu_command_passes_at_8_ranks(tmp_path):
    """README: `deepspeed --hostfile hostfile train.py --model_path ... --retriever_url ... --output_dir ...`
    (and `torchrun --nproc_per_node 8`) once failed at world size 8 on the default --prompts_per_step 4.
    With its own answer pool it passes on CUDA at world 8 and 16 (two nodes)."""
    from training.settings.config import resolve_defaults
    model, rows = tmp_path / "Qwen2.5-7B-Instruct", tmp_path / "rows.jsonl"
    model.mkdir(exist_ok=True)
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    for world, nodes in ((8, 1), (16, 2)):
        cfg = parse_config(["--model_path", str(model), "--retriever_url", "http://127.0.0.1:8000",
                            "--train_data", str(rows), "--output_dir", str(tmp_path / "runs/qwen7b")])
        resolve_defaults(cfg, world_size=world)
        validate_args(cfg, world_size=world, cuda=True, multi_node=nodes > 1)
        assert cfg.selfplay.prompts_per_step == 4 * world


def test_negative_prompts_per_step_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--prompts_per_step must be >= 1, or 0 for auto"):
        parse_config(_ok_paths(tmp_path) + ["--prompts_per_step", "-1"])


# ----------------------------------------------------------------------------- demo defaults

def _demo_cfg(*extra) -> Config:
    """The demo's defaults as they are, with the paths validate_args checks on disk left alone."""
    cfg = Config()
    if extra:
        ns = build_parser().parse_args(list(extra))
        for group in ("model", "search", "selfplay"):
            for k in vars(getattr(cfg, group)):
                setattr(getattr(cfg, group), k, getattr(ns, k))
    return cfg


def _demo_errors(cfg, **kw) -> str:
    try:
        validate_args(cfg, **kw)
        return ""
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("where", [dict(cuda=True, multi_node=False), dict(cuda=False, multi_node=True),
                                   dict(cuda=True, multi_node=True)])
def test_demo_defaults_are_refused_on_cuda_or_across_nodes(where):
    msg = _demo_errors(_demo_cfg(), world_size=8, **where)
    assert msg.count("CPU demo's defaults") == 1, msg          # one message, naming each default and its flag
    assert "--model_path data/models/SmolLM2-135M-Instruct" in msg and "pass --model_path with" in msg
    assert "--index data/indexes/bm25" in msg and "pass --retriever_url with your retrieval server" in msg
    assert "--train_data data/train/proposer.jsonl" in msg and "pass --train_data with your proposer rows" in msg
    assert "--allow_demo_defaults true" in msg
    assert ("on CUDA" in msg) == where["cuda"] and ("across nodes" in msg) == where["multi_node"]


def test_demo_defaults_pass_on_cpu_on_one_node_and_on_purpose():
    from training.settings.launch_env import demo_default_errors
    assert demo_default_errors(_demo_cfg(), cuda=False, multi_node=False) == []
    assert demo_default_errors(_demo_cfg("--allow_demo_defaults", "true"), cuda=True, multi_node=True) == []
    assert "CPU demo's defaults" not in _demo_errors(_demo_cfg("--allow_demo_defaults", "true"), world_size=8,
                                                     cuda=True, multi_node=True)


def test_only_the_demo_defaults_in_use_are_named():
    from training.settings.launch_env import demo_defaults_in_use
    names = lambda cfg: [x.split()[0] for x in demo_defaults_in_use(cfg)]  # noqa: E731
    assert names(_demo_cfg()) == ["--model_path", "--index", "--train_data"]
    assert names(_demo_cfg("--retriever_url", "http://h:8000")) == ["--model_path", "--train_data"]
    assert names(_demo_cfg("--proposer_search", "none", "--solver_search", "self")) == ["--model_path", "--train_data"]
    assert names(_demo_cfg("--self_play_enable", "false")) == ["--model_path", "--index"]
    # "still the default" is the dataclass default, typed or not
    assert names(_demo_cfg("--model_path", "data/models/SmolLM2-135M-Instruct", "--retriever_url", "http://h:8000",
                           "--train_data", "/data/rows.parquet")) == ["--model_path"]


def test_node_count_reads_the_launchers_environment():
    from training.settings.launch_env import node_count
    assert node_count({}) == 1
    assert node_count({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1          # torchrun, one node
    assert node_count({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert node_count({"WORLD_SIZE": "16", "LOCAL_SIZE": "8", "CROSS_SIZE": "2"}) == 2  # deepspeed launcher
    assert node_count({"WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}) == 2


# ----------------------------------------------------------------------------- flag names and help

def test_ppo_mini_batches_is_a_count_and_a_verl_size_is_refused(tmp_path):
    from training.settings.config import AlgoArgs
    help_ = AlgoArgs.__dataclass_fields__["ppo_mini_batches"].metadata["help"]
    assert "COUNT, not a size" in help_ and "ppo_mini_batch_size" in help_ and "256 / 64 -> 4" in help_
    cfg = parse_config(_ok_paths(tmp_path) + ["--prompts_per_step", "256", "--ppo_mini_batches", "4"])
    validate_args(cfg, world_size=8)
    cfg = parse_config(_ok_paths(tmp_path) + ["--prompts_per_step", "256", "--ppo_mini_batches", "256"])
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, world_size=8)
    assert "--ppo_mini_batches 256 is a count of mini-batches per step, not a size" in str(e.value)
    assert "each rank plays 32 prompt(s) a step" in str(e.value) and "B / S" in str(e.value)


def test_role_flags_say_they_train_the_role_and_keep_both_spellings(tmp_path):
    from training.settings.config import SelfPlayArgs
    for role in ("proposer", "solver"):
        assert SelfPlayArgs.__dataclass_fields__[f"{role}_enable"].metadata["help"].startswith(f"train the {role} role")
        for flag in (f"--{role}_enable", f"--train_{role}"):
            cfg = parse_config(_ok_paths(tmp_path) + [flag, "false"])
            assert getattr(cfg.selfplay, f"{role}_enable") is False


def test_helps_say_what_the_flag_is():
    """Not just where a value comes from or a bare noun: every help is a sentence of some length."""
    p = build_parser()
    short = [a.dest for a in p._actions if a.dest != "help" and len(a.help) < 20]
    assert short == [], short
    helps = {a.dest: a.help for a in p._actions}
    assert "GPU index" in helps["local_rank"] and "global gradient norm" in helps["max_grad_norm"]
    assert "--faiss-gpus" in helps["retriever_gpu_gb"] and "0 = it runs elsewhere" in helps["retriever_gpu_gb"]


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
    from inference.game import GameConfig   # the game's own default is "auto" too, resolved by the same rule
    assert GameConfig(rag_verify=rag).proposer_reward == want
    assert GameConfig(rag_verify=rag, proposer_reward="1-acc").proposer_reward == "1-acc"


def test_refill_and_the_search_count_mix_pass_when_complete(tmp_path):
    cfg = parse_config(_ok_paths(tmp_path) + ["--min_informative_groups", "8", "--max_rounds", "3",
                                              "--drop_flat_solver_groups", "true", "--search_turns_mix", "4:3:2:1",
                                              "--searches_at_least_n", "true"])
    assert (cfg.algorithm.min_informative_groups, cfg.algorithm.max_rounds) == (8, 3)
    assert cfg.selfplay.search_turns_mix == "4:3:2:1" and cfg.selfplay.searches_at_least_n
    # off by default: one round a step, each row its own n, --min_searches for every question
    d = parse_config(_ok_paths(tmp_path))
    assert (d.algorithm.min_informative_groups, d.selfplay.search_turns_mix, d.selfplay.searches_at_least_n) == (0, "", False)
    parse_config(_ok_paths(tmp_path) + ["--max_rounds", "1"])            # R without N: nothing to refuse


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

    from training.algorithm.lr_schedule import set_lr
    cfg = Config()
    o = cfg.optimisation
    o.lr, o.warmup_steps, o.total_steps, o.lr_schedule = 1e-3, 2, 10, "cosine"
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.0}, {"lr": 0.0}]))
    for step in range(10):
        want = 1e-3 * ((step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 8)))
        assert set_lr(engine, cfg, step) == pytest.approx(want)
        assert all(g["lr"] == pytest.approx(want) for g in engine.optimizer.param_groups)


def test_auto_prompts_per_step_keeps_a_resumed_runs_value(tmp_path):
    """--prompts_per_step 0 on a folder whose config.json recorded B: B stays when the new world
    can play it (a resume on other GPUs), so the run is not refused as a changed batch size."""
    import json

    from training.engine.setup import keep_recorded_prompts_per_step
    cfg = Config()
    cfg.logging.output_dir = str(tmp_path)
    assert keep_recorded_prompts_per_step(cfg) is False            # no config.json yet
    (tmp_path / "config.json").write_text(json.dumps({"selfplay": {"prompts_per_step": 32}}))
    assert keep_recorded_prompts_per_step(cfg) is True and cfg.selfplay.prompts_per_step == 32
    cfg.selfplay.prompts_per_step, cfg.rollout.vllm_tp = 0, 1
    (tmp_path / "config.json").write_text(json.dumps({"selfplay": {"prompts_per_step": 0}}))
    assert keep_recorded_prompts_per_step(cfg) is False and cfg.selfplay.prompts_per_step == 0
