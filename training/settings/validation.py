"""validate_args: the one refusal of a configuration that cannot work, saying why.

It joins each settings group's own `check()` (training/settings/settings_play.py, training/settings/settings_learn.py: a bad value
of one group's fields) with the checks that read two groups or the launch: here (`cross_group_errors`), the
critic's (training/settings/critic_config.py), the refill lever's (`refill_errors`: training/loop/rounds.py plays the refill) and the CPU demo's
defaults (training/settings/launch_env.py). Takes a training.settings.config.Config but imports none (config.py imports this)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from inference.data import parse_search_turns_mix
from inference.rollout import ROLLOUT_FLAGS, rollout_flag_errors
from training.settings.critic_config import critic_errors, needs_critic
from training.settings.launch_env import cuda_present, demo_default_errors, node_count
from training.settings.settings_play import AUTO_PROMPTS_PER_GROUP
from utils.errors import InputError

GROUP_ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce++_baseline")  # their baseline is the group's own mean


class ConfigError(InputError):
    pass


def needs_reference(cfg) -> bool:
    """The frozen reference model is built for the KL penalty, or as the self-distillation teacher."""
    d = cfg.distill
    return cfg.algorithm.kl_coef > 0 or cfg.critic.kl_in_reward > 0 or (d.distill != "off" and d.distill_teacher == "reference")


def group_errors(cfg) -> list[str]:
    """Every settings group's own check(), joined in the order Config declares them; the critic's only when a role
    uses --*_estimator gae (otherwise no critic is built, and its fields are never read)."""
    return [e for f in fields(cfg) if f.name != "critic" or needs_critic(cfg) for e in getattr(cfg, f.name).check()]


def cross_group_errors(cfg, world_size: int | None = None) -> list[str]:
    """The refusals that read fields of two groups, or the world size."""
    r, sp, a, d, o = cfg.rollout, cfg.selfplay, cfg.algorithm, cfg.distill, cfg.optimisation
    # RolloutConfig's own rules, on the flags that feed it (training/setup.protocol_rollout_config), refused here
    # rather than when the first round builds it, after the model and vLLM have loaded
    errs = rollout_flag_errors({k: getattr(cfg.search if k == "topk" else r, k) for k in ROLLOUT_FLAGS})
    if a.solver_estimator in GROUP_ESTIMATORS and sp.solver_n < 2:
        errs.append(f"--solver_estimator {a.solver_estimator} needs a group: --solver_n must be >= 2 (got {sp.solver_n})")
    if a.proposer_estimator in GROUP_ESTIMATORS and sp.proposer_n < 2:
        errs.append(f"--proposer_estimator {a.proposer_estimator} with --proposer_n {sp.proposer_n}: a group of one has no "
                    f"baseline, so every proposer advantage is 0 and the proposer never learns; use reinforce++ or ema, "
                    f"or set --proposer_n >= 2")
    if a.tis_cap and r.temperature != 1.0:
        errs.append("--tis_cap compares train log-probs with vLLM's raw (temperature-1) log-probs; it needs --temperature 1.0")
    if a.old_logprobs == "rollout" and (r.temperature != 1.0 or r.top_p != 1.0):
        errs.append(f"--old_logprobs rollout uses vLLM's raw (temperature-1, full-vocabulary) log-probs; it needs "
                    f"--temperature 1 and --top_p 1 (got {r.temperature}, {r.top_p}); use --old_logprobs recompute")
    if d.distill != "off":
        if not sp.solver_enable:
            errs.append(f"--distill {d.distill} trains the solver toward a teacher: it needs --solver_enable true")
        if d.distill == "contrast" and not sp.self_play_enable:
            errs.append("--distill contrast scores the solver's tokens under its question's construction path against "
                        "another question's; fixed QA rows have none: it needs --self_play_enable true")
        # +32: the block's blank lines and the chat template's room around it
        if o.micro_token_budget < r.max_total_tokens + d.distill_context_tokens + 32:
            errs.append(f"--micro_token_budget {o.micro_token_budget} cannot hold a teacher sequence (--max_total_tokens "
                        f"{r.max_total_tokens} + --distill_context_tokens {d.distill_context_tokens} + 32); raise it "
                        f"or lower --distill_context_tokens")
    if r.vllm_tp > 1:
        # A TP group's ranks must feed their engine the same prompts: the round's loop asks the outside world on the
        # group's first rank alone and shares what came back (inference/step_loop.py), under either schedule.
        sim = [f"--{role}_search" for role in ("proposer", "solver") if getattr(cfg.search, f"{role}_search") == "simulated"]
        if sim and not cfg.search.sim_url:
            errs.append(f"{' and '.join(sim)} simulated without --sim_url writes documents with the policy's own engine, "
                        f"which cannot run beside the tensor-parallel round's loop (--vllm_tp {r.vllm_tp}); serve the "
                        f"simulator and pass --sim_url, or use --vllm_tp 1")
    if o.micro_token_budget < r.max_total_tokens:
        errs.append(f"--micro_token_budget {o.micro_token_budget} is smaller than one trajectory can be "
                    f"(--max_total_tokens {r.max_total_tokens}); packing could not place it")
    searching = ([f"--rag_verify {sp.rag_verify}"] if sp.rag_verify in ("retrieval", "policy+retrieval") else []) + \
        ([f"--shortcut_filter {sp.shortcut_filter}"] if sp.shortcut_filter in ("title", "both") else [])
    if searching and sp.self_play_enable and cfg.search.solver_search != "retriever":
        errs.append(f"{' and '.join(searching)} search each question with "
                    f"the solver's back-end, but --solver_search is {cfg.search.solver_search}: a simulated search "
                    f"writes its documents for the policy (they say nothing about what a search finds), self and none "
                    f"have none; use --solver_search retriever")
    if sp.proposer_seed == "articles" and not (Path(cfg.search.index) / "docs.arrow").exists():
        errs.append(f"--proposer_seed articles draws answers from --index's documents, but "
                    f"{cfg.search.index}/docs.arrow does not exist (also needed with --retriever_url): build the index "
                    f"or point --index at it")
    if sp.self_play_enable and sp.min_searches > r.max_turns - 1:
        errs.append(f"--min_searches {sp.min_searches} needs --max_turns >= {sp.min_searches + 1} (got {r.max_turns}): "
                    f"the proposer searches that many times and then needs one more turn to write the question")
    return errs + world_errors(cfg, world_size)


def world_errors(cfg, world_size: int | None) -> list[str]:
    """The refusals that need the world size (None before it is known: none then): how --vllm_tp and
    --prompts_per_step split over the ranks, and whether --ppo_mini_batches finds groups to fill."""
    r, sp, a, errs = cfg.rollout, cfg.selfplay, cfg.algorithm, []
    if world_size is None or r.vllm_tp < 1:  # --vllm_tp < 1 is RolloutArgs.check()'s refusal
        return errs
    if world_size % r.vllm_tp:
        errs.append(f"--vllm_tp {r.vllm_tp} must divide the world size {world_size}")
    elif sp.prompts_per_step % (world_size // r.vllm_tp):  # 0 (auto) always fits
        dp = world_size // r.vllm_tp
        near = [k for k in (sp.prompts_per_step // dp * dp, (sp.prompts_per_step // dp + 1) * dp) if k]
        errs.append(f"--prompts_per_step {sp.prompts_per_step} must be a multiple of the data-parallel size {dp} "
                    f"(world size {world_size} / --vllm_tp {r.vllm_tp}): each data-parallel group plays the same "
                    f"number of games so collectives line up; e.g. {' or '.join(map(str, near))}, or 0 for auto "
                    f"({AUTO_PROMPTS_PER_GROUP} per group: {AUTO_PROMPTS_PER_GROUP * dp})")
    if sp.prompts_per_step > 0 and a.ppo_mini_batches > 1:
        per_group = max(1, sp.prompts_per_step // max(1, world_size // r.vllm_tp))
        if a.ppo_mini_batches > 2 * per_group:
            errs.append(f"--ppo_mini_batches {a.ppo_mini_batches} is a count of mini-batches per step, not a size "
                        f"(veRL's ppo_mini_batch_size): each rank plays {per_group} prompt(s) a step, so it holds at "
                        f"most {2 * per_group} groups (a proposer group and a solver group per prompt) and "
                        f"{a.ppo_mini_batches} mini-batches would leave some empty; for veRL's size S pass "
                        f"--ppo_mini_batches B / S with B = --prompts_per_step {sp.prompts_per_step}")
    return errs


def refill_errors(cfg) -> list[str]:
    """Why --min_informative_groups / --max_rounds / --search_turns_mix cannot run as given ([] when they can)."""
    a, sp, errs = cfg.algorithm, cfg.selfplay, []
    n, r = a.min_informative_groups, a.max_rounds
    if n < 0 or r < 1:
        errs.append(f"--min_informative_groups must be >= 0 (0 = off) and --max_rounds >= 1 (got {n}, {r})")
    elif n:
        if r == 1:
            errs.append(f"--min_informative_groups {n} refills a step with more rounds, but --max_rounds 1 allows "
                        f"none: pass --max_rounds 2 or more, or --min_informative_groups 0")
        if not a.drop_flat_solver_groups:
            # refused, not switched on behind the flag's back: config.json then says what ran, and an explicit
            # --drop_flat_solver_groups false is never overridden
            errs.append("--min_informative_groups plays rounds until the step holds N informative solver groups; "
                        "the flat groups every round also plays would still enter the loss with advantage 0 and "
                        "dilute its normaliser (DAPO filters them out): add --drop_flat_solver_groups true")
        if not sp.solver_enable:
            errs.append("--min_informative_groups counts the solver's informative groups, which carry no loss with "
                        "--solver_enable false")
        if not sp.self_play_enable and not sp.qa_data:
            errs.append("--min_informative_groups refills a step from the next rows: it needs self-play (proposer "
                        "rows) or --qa_data")
    try:
        parse_search_turns_mix(sp.search_turns_mix)
    except ValueError as e:
        errs.append(f"--{e}")
    if sp.search_turns_mix.strip() and not sp.self_play_enable:
        errs.append("--search_turns_mix draws the proposer's search counts; --self_play_enable false has no proposer")
    return errs


def validate_args(cfg, world_size: int | None = None, *, cuda: bool | None = None,
                  multi_node: bool | None = None) -> None:
    """Refuse combinations that cannot work, saying why: each group's own check(), then the checks across groups.
    Called at parse time and again once the world size is known. `cuda` / `multi_node` (None = detect:
    `cuda_present`, `node_count`) decide whether the CPU demo's defaults are refused (`demo_default_errors`)."""
    errs = group_errors(cfg) + cross_group_errors(cfg, world_size) + critic_errors(cfg) + refill_errors(cfg)
    errs += demo_default_errors(cfg, cuda_present() if cuda is None else cuda,
                                node_count() > 1 if multi_node is None else multi_node)
    if errs:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
