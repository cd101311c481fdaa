"""What the step loop needs before its first step, built once per run (training/loop/trainer.py wires it):

    resolve_config(cfg)                      # --prompts_per_step 0 (auto), defaults, validate_args (world known)
    llm, engines = build_models(cfg, ...)    # rollout engine (vLLM or HF) and the DeepSpeed engines, in that order
    game_config(cfg, dp_rank)                # train.py's flags -> inference.game.GameConfig
    seeded_pool / training_rows / build_judge
    rollout_configs(cfg, step, dp_rank)      # each role's RolloutConfig of a step (its seed moves with the step)

The search tools are built in training/loop/search.py, the simulated-search curriculum kept in training/loop/curriculum.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference.data import ArticleRows, clamp_search_turns
from inference.engine_api import RolloutEngine
from inference.engines import VLLMEngine
from inference.game import SEED_STEP, GameConfig, QuestionPool
from inference.hf_engine import HFEngine
from inference.judge import Judge
from inference.rollout import RolloutConfig
from retrieval.corpus import DocStore
from training.settings.config import AUTO_PROMPTS_PER_GROUP, Config, resolve_defaults, validate_args
from training.settings.launch_env import demo_defaults_in_use, node_count
from utils import dist as D
from utils.logging import print0

if TYPE_CHECKING:
    from training.engine.engine_builder import Engines


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------ the config, once the world is known

def resolve_config(cfg: Config) -> None:
    """Resolve the run's defaults for this world and validate them (in place; call after init_distributed)."""
    auto_b = cfg.selfplay.prompts_per_step == 0
    if auto_b and cfg.checkpointing.resume != "none" and not cfg.checkpointing.overwrite:
        auto_b = not keep_recorded_prompts_per_step(cfg)
    resolve_defaults(cfg, world_size=D.world_size())
    cuda, multi_node = torch.cuda.is_available(), node_count() > 1
    validate_args(cfg, world_size=D.world_size(), cuda=cuda, multi_node=multi_node)
    if auto_b:
        print0(f"--prompts_per_step 0 (auto): {cfg.selfplay.prompts_per_step} prompts per step, "
               f"{AUTO_PROMPTS_PER_GROUP} per data-parallel group")
    demo = demo_defaults_in_use(cfg) if (cuda or multi_node) else []
    if demo:  # validate_args let them through: --allow_demo_defaults true
        print0("--allow_demo_defaults true: running with the CPU demo's defaults on purpose:\n  "
               + "\n  ".join(demo))


def keep_recorded_prompts_per_step(cfg: Config) -> bool:
    """--prompts_per_step 0 (auto) on a run folder that recorded a value: keep the run's B when
    the new world can play it (a resume on another number of GPUs), rather than resolving to a
    new B that config.json would then refuse as a run-defining change. Rank 0 reads, all agree."""
    old = None
    if D.is_main():
        try:
            old = json.loads((Path(cfg.logging.output_dir) / "config.json").read_text())["selfplay"]["prompts_per_step"]
        except (OSError, ValueError, KeyError, TypeError):
            old = None
    old = D.all_gather_object(old)[0]
    dp = D.world_size() // max(1, cfg.rollout.vllm_tp)
    if isinstance(old, int) and old > 0 and dp > 0 and old % dp == 0:
        cfg.selfplay.prompts_per_step = old
        print0(f"--prompts_per_step 0 (auto): keeping this run's {old} from its config.json")
        return True
    return False


# ------------------------------------------------------------------ engines

def build_models(cfg: Config, rank: int, dp_rank: int, world: int) -> tuple[RolloutEngine, Engines]:
    """(rollout engine, training.engine.engine_builder's engines). Seeds every rank first, and again after vLLM,
    whose LLM() reseeds every rank to 0 (docs/PLATFORM_NOTES.md, Hybrid engine rules)."""
    from training.engine.engine_builder import build_engines

    seed_everything(cfg.optimisation.seed + rank)
    dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
    r = cfg.rollout
    llm: RolloutEngine
    if r.rollout_engine == "hf":
        # Built before the actor: while an HfDeepSpeedConfig is alive from_pretrained would
        # partition this copy under zero.Init too. Seeds are per prompt, so no engine seed.
        llm = HFEngine(cfg.model.model_path, dtype=dtype, device=D.local_device(), batch_size=64,
                       max_model_len=r.max_model_len)
    engines = build_engines(cfg)
    if r.rollout_engine == "vllm":
        llm = VLLMEngine(cfg.model.model_path, dtype=dtype, seed=cfg.optimisation.seed + dp_rank,
                         tensor_parallel_size=r.vllm_tp, external_launcher=world > 1,
                         kv_cache_memory_bytes=(r.kv_cache_mb << 20) or None, max_model_len=r.max_model_len,
                         gpu_memory_utilization=r.gpu_memory_utilization)
    seed_everything(cfg.optimisation.seed + rank)
    return llm, engines


# ------------------------------------------------------------------ the game's side

def game_config(cfg: Config, dp_rank: int) -> GameConfig:
    """train.py's self-play flags as the game's settings (the flags take their defaults from GameConfig)."""
    sp = cfg.selfplay
    return GameConfig(
        proposer_n=sp.proposer_n, solver_n=sp.solver_n, template=cfg.model.template,
        min_searches=sp.min_searches, min_question_words=sp.min_question_words,
        searches_at_least_n=sp.searches_at_least_n,
        rag_verify=sp.rag_verify, rag_distractors=sp.rag_distractors, shortcut_filter=sp.shortcut_filter,
        use_pool=sp.use_pool, pool_size=sp.pool_size, pool_min_solve_rate=sp.pool_min_solve_rate,
        pool_max_solve_rate=sp.pool_max_solve_rate, pool_clear_every=sp.pool_clear_every,
        proposer_reward=sp.proposer_reward, format_penalty=sp.format_penalty,
        self_search_format_reward=cfg.search.self_search_format_reward,
        seed=cfg.optimisation.seed + 7919 * dp_rank)


def build_judge(cfg: Config, out: Path) -> Judge:
    sp = cfg.selfplay
    if sp.judge == "llm":
        return Judge(url=sp.judge_url, model=sp.judge_model or None, cache_path=out / "judge_cache.sqlite",
                     timeout_s=sp.judge_timeout_s, retries=sp.judge_retries, cooldown_s=sp.judge_cooldown_s)
    return Judge()


def seeded_pool(cfg: Config, rows, dp_rank: int) -> QuestionPool:
    """The question pool with --pool_init's rows (the user's rows: clearing keeps them)."""
    pool = QuestionPool(cfg.selfplay.pool_size, seed=cfg.optimisation.seed + dp_rank)
    for r in rows:
        pool.add(r.question, r.golden_answers, step=SEED_STEP)
    return pool


def training_rows(cfg: Config, rows: list) -> list:
    """--train_data's proposer rows, their search counts clamped into [--min_searches, --max_turns - 1]; with
    --proposer_seed articles, rows drawn from --index's documents instead (n = --min_searches, at least 1, until
    --search_turns_mix redraws it)."""
    sp, hi = cfg.selfplay, cfg.rollout.max_turns - 1
    if sp.proposer_seed == "articles":
        return ArticleRows(DocStore(cfg.search.index), cfg.optimisation.seed, min(max(sp.min_searches, 1), hi))
    moved = clamp_search_turns(rows, sp.min_searches, hi)
    if moved:
        print0(f"--train_data: {moved} of {len(rows)} rows ask for a search count outside "
               f"[--min_searches {sp.min_searches}, --max_turns - 1 = {hi}]; clamped into it")
    return rows


def protocol_rollout_config(cfg: Config) -> RolloutConfig:
    """The run's rollout protocol (turns, token budgets, search depth, sampling, schedule): the one place the
    flags become a RolloutConfig; training and the periodic eval derive theirs from it."""
    r = cfg.rollout
    return RolloutConfig(
        max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, max_tokens_per_turn=r.max_tokens_per_turn,
        max_info_tokens=r.max_info_tokens, topk=cfg.search.topk, temperature=r.temperature, top_p=r.top_p,
        schedule=r.rollout_schedule, max_inflight=r.max_inflight)


def rollout_configs(cfg: Config, step: int, dp_rank: int) -> dict[str, RolloutConfig]:
    """Each role's rollout settings of one step; the sampling seed is a function of (seed, step, rank)."""
    base = protocol_rollout_config(cfg)
    return {role: replace(base, seed=cfg.optimisation.seed * 1_000_003 + step * 1009 + dp_rank,
                          self_search=getattr(cfg.search, f"{role}_search") == "self", progress=D.is_main())
            for role in ("proposer", "solver")}


def eval_rollout_config(cfg: Config) -> RolloutConfig:
    """The periodic held-out eval's rollout settings: the training protocol, greedy (top_p back to 1)."""
    return replace(protocol_rollout_config(cfg), temperature=0.0, top_p=1.0)
