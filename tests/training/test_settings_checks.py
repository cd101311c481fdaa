"""Each settings group checks its own fields (issue 34, point 2): `check()` refuses a bad value of one of them with
a message that names the flag and the value; validate_args joins those checks with the ones across groups, which
no single group can make. The distillation settings are their own group (cfg.distill), and a run folder whose
config.json still holds them under "algorithm" resumes."""

from __future__ import annotations

import json
import zipfile
from dataclasses import fields, replace

import pytest

from training.settings.config import (GROUPS, AlgoArgs, CkptArgs, Config, ConfigError, CriticArgs, DeepSpeedArgs, DistillArgs,
                             EvalArgs, LogArgs, ModelArgs, OptimArgs, RolloutArgs, SearchArgs, SelfPlayArgs,
                             build_parser, upgrade_saved_config, validate_args)
from training.settings.validation import group_errors


def _paths(tmp_path) -> dict:
    """Groups whose path fields point at files that exist, so that only the value under test can be wrong."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "idx").mkdir(exist_ok=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    return {ModelArgs: {"model_path": str(tmp_path / "model")}, SearchArgs: {"index": str(tmp_path / "idx")},
            SelfPlayArgs: {"train_data": str(rows)}}


def _ok_cfg(tmp_path) -> Config:
    paths = _paths(tmp_path)
    return Config(**{name: cls(**paths.get(cls, {})) for name, cls in GROUPS.items()})


# (group, {field: bad value, plus what makes the field count}, the flag the message names, the bad value as printed)
BAD = [
    (ModelArgs, {"train_top_layers": -1}, "--train_top_layers", "-1"),
    (ModelArgs, {"model_path": "/nonexistent/model"}, "--model_path", "/nonexistent/model"),
    (RolloutArgs, {"temperature": 0.0}, "--temperature", "got 0"),
    (RolloutArgs, {"vllm_tp": 0}, "--vllm_tp", "got 0"),
    (RolloutArgs, {"max_total_tokens": 99999}, "--max_total_tokens", "99999"),
    (RolloutArgs, {"rollout_engine": "hf", "vllm_tp": 2}, "--vllm_tp", "2"),
    (SearchArgs, {"sim_noise_start": 1.5}, "--sim_noise_start", "1.5"),
    (SearchArgs, {"index": "/nonexistent/idx"}, "--index", "/nonexistent/idx"),
    (SearchArgs, {"self_search_format_reward": True}, "--self_search_format_reward", "--solver_search self"),
    (SelfPlayArgs, {"solver_n": 0}, "--solver_n", "0"),
    (SelfPlayArgs, {"prompts_per_step": -2}, "--prompts_per_step", "-2"),
    (SelfPlayArgs, {"proposer_warm_up_steps": -1}, "--proposer_warm_up_steps", "-1"),
    (SelfPlayArgs, {"pool_size": 0}, "--pool_size", "0"),
    (SelfPlayArgs, {"min_question_words": -1}, "--min_question_words", "-1"),
    (SelfPlayArgs, {"pool_init": "/nonexistent/pool.jsonl"}, "--pool_init", "/nonexistent/pool.jsonl"),
    (SelfPlayArgs, {"judge": "llm"}, "--judge_url", "--judge llm"),
    # issue 41 (3): the game's levers name a bad value (argparse's choices catch it on the command line only)
    (SelfPlayArgs, {"rag_verify": "retrieve"}, "--rag_verify", "'retrieve'"),
    (SelfPlayArgs, {"shortcut_filter": "always"}, "--shortcut_filter", "'always'"),
    (SelfPlayArgs, {"proposer_seed": "questions"}, "--proposer_seed", "'questions'"),
    (AlgoArgs, {"dual_clip": 0.5}, "--dual_clip", "0.5"),
    (AlgoArgs, {"ppo_epochs": 0}, "--ppo_epochs", "0"),
    (AlgoArgs, {"clip_low": 1.0}, "clip_low", "1.0"),
    (DistillArgs, {"distill": "topk", "distill_topk": 0}, "--distill_topk", "got 0"),
    (DistillArgs, {"distill": "sampled", "distill_context_tokens": 0}, "--distill_context_tokens", "got 0"),
    (DistillArgs, {"distill": "contrast", "distill_coef": -0.5}, "--distill_coef", "-0.5"),
    (DistillArgs, {"distill": "sampled", "distill_coef_floor": 0.3}, "--distill_coef_floor", "0.3"),
    (CriticArgs, {"gae_gamma": 1.5}, "--gae_gamma", "1.5"),
    (CriticArgs, {"value_clip": -1.0}, "--value_clip", "-1.0"),
    (CriticArgs, {"critic_warmup": -1}, "--critic_warmup", "-1"),
    (OptimArgs, {"max_failed_share": 1.5}, "--max_failed_share", "1.5"),
    (OptimArgs, {"max_nonfinite_steps": 0}, "--max_nonfinite_steps", "0"),
    (LogArgs, {"report_to": "comet"}, "--report_to", "comet"),
]


@pytest.mark.parametrize("cls, bad, flag, shown", BAD, ids=[f"{c.__name__}-{'-'.join(b)}" for c, b, _, _ in BAD])
def test_a_group_refuses_a_bad_value_of_its_own_field(tmp_path, cls, bad, flag, shown):
    good = cls(**_paths(tmp_path).get(cls, {}))
    assert good.check() == []   # the defaults (with paths that exist) pass, so the message below is the bad value's
    errs = replace(good, **bad).check()
    named = [e for e in errs if flag in e]
    assert len(named) == 1 and shown in named[0], errs
    # and validate_args, which joins the groups' checks, refuses the same config with the same message
    cfg = _ok_cfg(tmp_path)
    name = next(g for g, c in GROUPS.items() if c is cls)
    setattr(cfg, name, replace(good, **bad))
    if cls is CriticArgs:
        cfg.algorithm.solver_estimator = "gae"   # the critic's fields are checked only when a critic is built
    if cls is DistillArgs:
        cfg.optimisation.micro_token_budget = 16384   # room for the teacher sequence: only the value under test is bad
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, cuda=False, multi_node=False)
    assert named[0] in str(e.value)


def test_every_group_has_a_check_and_the_defaults_pass(tmp_path):
    assert set(GROUPS) == {f.name for f in fields(Config)}
    assert all(callable(getattr(cls, "check", None)) for cls in GROUPS.values())
    assert group_errors(_ok_cfg(tmp_path)) == []
    validate_args(_ok_cfg(tmp_path), world_size=1, cuda=False, multi_node=False)
    # groups with nothing of their own to refuse say so
    assert DeepSpeedArgs(zero_stage=0).check() == CkptArgs(save_every=0).check() == EvalArgs(eval_limit=1).check() == []


def test_switched_off_settings_are_not_checked(tmp_path):
    """--distill off leaves the distill_* values unread; without a gae role no critic is built: neither refuses."""
    assert DistillArgs(distill="off", distill_topk=0, distill_coef=-1.0).check() == []
    cfg = _ok_cfg(tmp_path)
    cfg.distill = DistillArgs(distill="off", distill_topk=0, distill_context_tokens=0)
    cfg.critic = CriticArgs(gae_gamma=1.5, value_clip=-1.0)
    validate_args(cfg, cuda=False, multi_node=False)
    cfg.algorithm.proposer_estimator = "gae"
    with pytest.raises(ConfigError, match=r"--gae_gamma and --gae_lambda must be in \[0, 1\] \(got 1.5, 1.0\)"):
        validate_args(cfg, cuda=False, multi_node=False)


# cross-group refusals: each group alone passes its check(), only the combination is refused
CROSS = [
    ({"algorithm": {"solver_estimator": "rloo"}, "selfplay": {"solver_n": 1}}, None, "needs a group"),
    ({"algorithm": {"tis_cap": 2.0}, "rollout": {"temperature": 0.7}}, None, "needs --temperature 1.0"),
    ({"distill": {"distill": "sampled"}, "selfplay": {"solver_enable": False, "proposer_enable": True}}, None,
     "it needs --solver_enable true"),
    ({"distill": {"distill": "topk"}, "rollout": {"max_total_tokens": 4000, "max_model_len": 4096},
      "optimisation": {"micro_token_budget": 4096}}, None, "cannot hold a teacher sequence"),
    ({"optimisation": {"micro_token_budget": 100}}, None, "packing could not place"),
    ({"selfplay": {"min_searches": 3}, "rollout": {"max_turns": 3}}, None, "--min_searches 3 needs --max_turns >= 4"),
    ({"critic": {"kl_in_reward": 0.01}}, None, "no role uses --*_estimator gae"),
    ({"algorithm": {"min_informative_groups": 4}}, None, "add --drop_flat_solver_groups true"),
    ({"rollout": {"vllm_tp": 2}}, 3, "--vllm_tp 2 must divide the world size 3"),
    ({"selfplay": {"prompts_per_step": 5}}, 2, "--prompts_per_step 5 must be a multiple of the data-parallel size 2"),
    ({"selfplay": {"prompts_per_step": 2}, "algorithm": {"ppo_mini_batches": 8}}, 2,
     "--ppo_mini_batches 8 is a count of mini-batches per step"),
    # RolloutConfig's own rules (inference/rollout.rollout_errors) on the flags that feed it: refused here, before
    # anything loads, not when the first round builds the RolloutConfig (train.py spent 31 s to get there)
    ({"rollout": {"max_inflight": -1}}, None, "--max_inflight must be >= 0 (0 = no bound beyond the engine's own), "
                                              "got -1"),
    ({"rollout": {"max_turns": 0}, "selfplay": {"min_searches": 0}}, None, "--max_turns must be >= 1, got 0"),
    ({"rollout": {"max_tokens_per_turn": 0}}, None, "--max_tokens_per_turn must be >= 1, got 0"),
    ({"rollout": {"max_info_tokens": 5}}, None, "--max_info_tokens 5 leaves no room for the <information> tags"),
    ({"search": {"topk": 0}}, None, "--topk must be >= 1, got 0"),
    ({"rollout": {"rollout_schedule": "async"}}, None, "--rollout_schedule must be one of trajectory, turn, "
                                                       "got 'async'"),
    # issue 40 (1): the simulator on the policy's engine would generate on one rank of a TP group (the turn schedule
    # is the same loop in waves since issue 43, 1, and keeps the lockstep: tests/inference/test_sim_lockstep.py)
    ({"rollout": {"vllm_tp": 2}, "search": {"solver_search": "simulated"}}, 2,
     "--solver_search simulated without --sim_url writes documents with the policy's own engine"),
    # issue 41 (3): the question checks search with the solver's back-end; articles need the index's documents
    ({"selfplay": {"rag_verify": "retrieval"}, "search": {"solver_search": "simulated", "sim_url": "http://x"}}, None,
     "--rag_verify retrieval search each question with the solver's back-end, but --solver_search is simulated"),
    ({"selfplay": {"rag_verify": "policy+retrieval", "shortcut_filter": "both"}, "search": {"solver_search": "self"}},
     None, "--rag_verify policy+retrieval and --shortcut_filter both search each question"),
    ({"selfplay": {"shortcut_filter": "title"}, "search": {"solver_search": "none"}}, None,
     "--shortcut_filter title search each question with the solver's back-end, but --solver_search is none"),
    ({"selfplay": {"proposer_seed": "articles"}}, None,
     "--proposer_seed articles draws answers from --index's documents"),
]


@pytest.mark.parametrize("changes, world, needle", CROSS, ids=[n[:30] for _, _, n in CROSS])
def test_validate_args_refuses_cross_group_cases(tmp_path, changes, world, needle):
    cfg = _ok_cfg(tmp_path)
    for group, values in changes.items():
        setattr(cfg, group, replace(getattr(cfg, group), **values))
    assert group_errors(cfg) == []   # no group alone sees the problem
    with pytest.raises(ConfigError) as e:
        validate_args(cfg, world_size=world, cuda=False, multi_node=False)
    assert needle in str(e.value)


def test_distill_is_its_own_group_with_unchanged_flags(tmp_path):
    p = build_parser()
    titles = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
    distill_flags = {f.name for f in fields(DistillArgs)}
    assert all(titles[n] == "distill" for n in distill_flags)
    assert not distill_flags & {f.name for f in fields(AlgoArgs)}
    opts = {o for a in p._actions for o in a.option_strings}
    assert {f"--{n}" for n in distill_flags} == {"--distill", "--distill_coef", "--distill_topk", "--distill_schedule",
                                                 "--distill_coef_floor", "--distill_context_tokens",
                                                 "--distill_teacher", "--distill_hint"} <= opts
    ns = p.parse_args(["--distill", "contrast", "--distill_coef", "0.3"])
    assert (ns.distill, ns.distill_coef) == ("contrast", 0.3)


def _old_layout(d: dict) -> dict:
    """config.json as written before the distill group: every distill field under "algorithm"."""
    old = json.loads(json.dumps(d))
    old["algorithm"].update(old.pop("distill"))
    return old


def test_an_old_config_json_reads_in_todays_layout():
    cfg = Config()
    cfg.distill.distill, cfg.distill.distill_coef, cfg.algorithm.kl_coef = "sampled", 0.2, 0.01
    new = json.loads(json.dumps(cfg.to_dict()))
    old = _old_layout(new)
    assert "distill" not in old and old["algorithm"]["distill_coef"] == 0.2
    assert upgrade_saved_config(old) == new
    assert upgrade_saved_config(new) == new and old["algorithm"]["distill"] == "sampled"   # a copy: old untouched


def _old_run(tmp_path, cfg: Config):
    out = tmp_path / "run"
    ck = out / "checkpoints" / "step_000010"
    ck.mkdir(parents=True)
    for f in ("trainer_rank0.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        with zipfile.ZipFile(ck / f, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 100)
    (ck / "run_id").write_text("r1\n")
    (out / "checkpoints" / "run_id").write_text("r1\n")
    (out / "checkpoints" / "latest").write_text("step_000010\n")
    (out / "config.json").write_text(json.dumps(_old_layout(cfg.to_dict())))
    return out


def test_an_old_run_folder_resumes(tmp_path):
    """A run folder from before the distill group (its config.json holds --distill* under "algorithm") is the same
    run for the same settings: no run-defining field differs, the launch resumes its checkpoint and keeps its run id;
    a changed --distill_coef is still seen as another run."""
    from training.engine import run_folder as C
    from training.engine import run_state as S

    cfg = Config()
    cfg.logging.output_dir = str(tmp_path / "run")
    cfg.distill.distill, cfg.distill.distill_coef, cfg.distill.distill_context_tokens = "sampled", 0.2, 128
    out = _old_run(tmp_path, cfg)
    v = S.output_dir_verdict(out, cfg.to_dict())
    assert v.diffs == {} and v.refusal is None and not v.starts_over
    assert S.run_folder_errors(out, cfg.to_dict()) == []
    assert S.find_resume(out, "auto") == out / "checkpoints" / "step_000010"
    assert C.claim_output_dir(out, cfg.to_dict()) == "r1"   # the same run: its id is kept
    assert json.loads((out / "config.json").read_text())["distill"]["distill_coef"] == 0.2   # rewritten in today's layout

    other = replace(cfg, distill=replace(cfg.distill, distill_coef=0.3))
    (out / "config.json").write_text(json.dumps(_old_layout(cfg.to_dict())))
    v = S.output_dir_verdict(out, other.to_dict())
    assert v.diffs == {"distill.distill_coef": (0.2, 0.3)} and "distill.distill_coef: 0.2" in v.refusal


def test_the_levers_pass_where_they_can_run(tmp_path):
    """Issue 41 (3): the checks' search with --solver_search retriever, and articles with an index's docs.arrow, pass;
    --proposer_seed articles reads no --train_data, so a missing one is not refused."""
    cfg = _ok_cfg(tmp_path)
    (tmp_path / "idx" / "docs.arrow").write_bytes(b"")
    cfg.selfplay = replace(cfg.selfplay, rag_verify="policy+retrieval", shortcut_filter="both",
                           proposer_seed="articles", train_data=str(tmp_path / "missing.jsonl"))
    assert group_errors(cfg) == []
    validate_args(cfg, world_size=1, cuda=False, multi_node=False)
    ns = build_parser().parse_args(["--rag_verify", "retrieval", "--shortcut_filter", "queries", "--proposer_seed",
                                    "articles"])
    assert (ns.rag_verify, ns.shortcut_filter, ns.proposer_seed) == ("retrieval", "queries", "articles")
    assert (SelfPlayArgs().shortcut_filter, SelfPlayArgs().proposer_seed) == ("off", "answers")
