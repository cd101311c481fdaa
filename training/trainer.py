"""The SSP step loop. Every rank runs the same program (SPMD):

    for step in steps:
        hybrid.to_generate()                       # ZeRO-3 shards -> vLLM, prefix cache reset
        game = play_round(rows_of_this_rank)       # proposer -> filters -> RAG -> solver -> rewards
                                                   # (more rounds: --min_informative_groups, training/rounds.py)
        hybrid.to_train()                          # vLLM sleeps (GPU)
        old, ref = recompute log-probs             # packed, no grad
        values = critic(gae roles' trajectories)   # only when a role uses gae (training/critic.py)
        adv = advantages per role                  # each role its own estimator
        update(packed trajectories)                # clipped surrogate, global normaliser; then the critic's
        log, checkpoint, evaluate

A question's whole solver group stays on the rank that played it, so group
advantages are local; batch-wide statistics and the loss normaliser are all-reduced.
Every collective (ZeRO-3 forwards, GatheredParameters, all-reduces) is called the same
number of times on every rank: micro-batch counts are equalised with empty work.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from training.config import (AUTO_PROMPTS_PER_GROUP, Config, resolve_defaults,
                             validate_args)
from training.launch_env import demo_defaults_in_use, node_count
from training.critic import step_values, train_step_critic
from training.rounds import drop_flat_solver_groups, merge_rounds, play_rounds, round_rollout_cfg
from training.lr_schedule import set_lr
from training.update import changed_fraction, snapshot_weights
from inference.data import mix_search_turns
from inference.game import is_count
from utils import dist as D
from utils.logging import RunLogger, fmt_metrics, print0

# Counts summed over ranks (the rest are means): every token count is a global count. The game's own counts
# are inference.game.is_count's, named where the game makes them.
SUM_KEYS = ("actor/num_tokens", "search/sim_failures", "search/sim_docs", "game/flat_solver_groups",
            "train/proposer_tokens", "train/solver_tokens", "search/calls", "search/failures", "search/queries")


class TimedSearch:
    """Wraps a backend's `search` to count calls, queries, failures and seconds for the step metrics."""

    def __init__(self, backend):
        self.backend = backend
        # the rollout loop passes (question, answer) contexts to backends that want them (simulated search)
        self.wants_context = bool(getattr(backend, "wants_context", False))
        self.reset()

    def reset(self) -> None:
        self.calls = self.queries = self.failures = 0
        self.seconds = 0.0

    def search(self, queries: list[str], topk: int, contexts: list[dict] | None = None) -> list[list[dict]]:
        t0 = time.perf_counter()
        self.calls += 1
        self.queries += len(queries)
        try:
            if self.wants_context:
                return self.backend.search(queries, topk, contexts=contexts)
            return self.backend.search(queries, topk)
        except Exception:
            self.failures += 1
            raise  # the rollout loop records it per trajectory and carries on
        finally:
            self.seconds += time.perf_counter() - t0


def build_search_backend(cfg: Config, kind: str, engine=None, seed: int = 0):
    """The `search(queries, topk)` backend of one role; None for no tool and for self-search (SSRL),
    where the policy writes its own <information> (masked like retrieved text)."""
    s = cfg.search
    if kind == "none" or kind == "self":
        return None
    if kind == "simulated":
        from inference.simulated_search import SimulatedSearch
        return SimulatedSearch(url=s.sim_url or None, engine=None if s.sim_url else engine, model=s.sim_model or None,
                               noise_start=s.sim_noise_start, noise_end=s.sim_noise_end,
                               total_steps=cfg.optimisation.total_steps, seed=seed, template=cfg.model.template)
    if cfg.search.retriever_url:
        from retrieval.client import RetrievalClient
        return RetrievalClient(cfg.search.retriever_url)
    from retrieval.retriever import load_retriever
    return load_retriever(cfg.search.index)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SSPTrainer:
    def __init__(self, cfg: Config, inputs=None):
        """`inputs`: train.py's preflight (training/preflight.py), read before the process group; None reads them here."""
        D.init_distributed()
        auto_b = cfg.selfplay.prompts_per_step == 0
        if auto_b and cfg.checkpointing.resume != "none" and not cfg.checkpointing.overwrite:
            auto_b = not self._keep_recorded_prompts_per_step(cfg)
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
        self.cfg = cfg
        self.rank, self.world = D.rank(), D.world_size()
        self.out = Path(cfg.logging.output_dir)
        from training.checkpoint import find_resume, prepare_output_dir
        from training.preflight import preflight
        self.run_id = prepare_output_dir(cfg)  # refuses another run's folder unless --overwrite true
        self.inputs = inputs if inputs is not None else preflight(cfg)
        self.resume_from = find_resume(self.out, cfg.checkpointing.resume)  # a damaged checkpoint: refused before the model
        self.log = RunLogger(self.out, tensorboard=cfg.logging.tensorboard, report_to=cfg.logging.report_to,
                             config=cfg.to_dict())
        self._build()
        self.step = 0
        self.cursor = 0      # proposer rows consumed (global)
        self.qa_cursor = 0   # fixed QA rows consumed (global)
        self.ema_state: dict = {}
        from training.guards import FailureGuard, NonFiniteGuard
        o = cfg.optimisation
        self.failures = FailureGuard(o.max_failed_share, o.failed_share_window)
        self.nonfinite = NonFiniteGuard(o.max_nonfinite_steps)
        self._resume()

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _keep_recorded_prompts_per_step(cfg: Config) -> bool:
        """--prompts_per_step 0 (auto) on a run folder that recorded a value: keep the run's B when
        the new world can play it (a resume on another number of GPUs), rather than resolving to a
        new B that config.json would then refuse as a run-defining change. Rank 0 reads, all agree."""
        import json
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

    def _build(self) -> None:
        from inference.data import clamp_search_turns
        from inference.engines import VLLMEngine
        from inference.hf_engine import HFEngine
        from inference.game import SEED_STEP, GameConfig, QuestionPool
        from inference.judge import Judge
        from training.engine_builder import build_engines
        from training.hybrid import HybridEngine

        cfg = self.cfg
        seed_everything(cfg.optimisation.seed + self.rank)
        tp = cfg.rollout.vllm_tp
        # With TP > 1 every rank of a TP group must send identical prompts, so the group shares a seed
        # and a data shard (the rank's share is by TP group, not by rank).
        self.dp_rank, self.dp_world = self.rank // tp, self.world // tp
        dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
        if cfg.rollout.rollout_engine == "hf":
            # Built before the actor: while an HfDeepSpeedConfig is alive from_pretrained would
            # partition this copy under zero.Init too. Seeds are per prompt, so no engine seed.
            self.llm = HFEngine(cfg.model.model_path, dtype=dtype, device=D.local_device(), batch_size=64,
                                max_model_len=cfg.rollout.max_model_len)
        self.engines = build_engines(cfg)
        self.actor, self.critic = self.engines.actor, self.engines.critic
        if cfg.rollout.rollout_engine == "vllm":
            self.llm = VLLMEngine(
                cfg.model.model_path, dtype=dtype,
                seed=cfg.optimisation.seed + self.dp_rank, tensor_parallel_size=tp, external_launcher=self.world > 1,
                kv_cache_memory_bytes=(cfg.rollout.kv_cache_mb << 20) or None, max_model_len=cfg.rollout.max_model_len,
                gpu_memory_utilization=cfg.rollout.gpu_memory_utilization)
        seed_everything(cfg.optimisation.seed + self.rank)  # LLM() reseeds every rank to 0 (docs/PLATFORM_NOTES.md, Hybrid engine rules)
        self.tokenizer = self.llm.tokenizer
        self.hybrid = HybridEngine(self.actor, self.llm, bucket_mb=cfg.rollout.sync_bucket_mb)
        s, sp = cfg.search, cfg.selfplay
        backends: dict = {}  # one instance per kind, shared by the roles that use it
        for role in ("proposer", "solver"):
            kind = getattr(s, f"{role}_search")
            if kind not in backends:
                backends[kind] = build_search_backend(cfg, kind, engine=self.llm, seed=cfg.optimisation.seed + self.dp_rank)
        self.search = {role: (TimedSearch(b) if (b := backends[getattr(s, f"{role}_search")]) else None)
                       for role in ("proposer", "solver")}
        self.simulated = backends.get("simulated")
        self.judge = (Judge(url=sp.judge_url, model=sp.judge_model or None, cache_path=self.out / "judge_cache.sqlite")
                      if sp.judge == "llm" else Judge())
        self.game_cfg = GameConfig(
            proposer_samples=sp.proposer_n, solver_samples=sp.solver_n, template=cfg.model.template,
            min_searches=sp.min_searches, min_question_words=sp.min_question_words,
            searches_at_least_n=sp.searches_at_least_n,
            rag_verifier=sp.rag_verify, rag_distractors=sp.rag_distractors,
            pool_fill=sp.use_pool, pool_size=sp.pool_size, pool_min_solve_rate=sp.pool_min_solve_rate,
            pool_max_solve_rate=sp.pool_max_solve_rate, pool_clear_every=sp.pool_clear_every,
            proposer_reward=sp.proposer_reward, invalid_penalty=sp.format_penalty,
            seed=cfg.optimisation.seed + 7919 * self.dp_rank)
        self.pool = QuestionPool(sp.pool_size, seed=cfg.optimisation.seed + self.dp_rank)
        for r in self.inputs.pool_rows:
            self.pool.add(r.question, r.golden_answers, step=SEED_STEP)  # the user's rows: clearing keeps them
        self.rows = self.inputs.rows
        moved = clamp_search_turns(self.rows, sp.min_searches, cfg.rollout.max_turns - 1)
        if moved:
            print0(f"--train_data: {moved} of {len(self.rows)} rows ask for a search count outside "
                   f"[--min_searches {sp.min_searches}, --max_turns - 1 = {cfg.rollout.max_turns - 1}]; clamped into it")
        self.qa_rows, self.eval_rows = self.inputs.qa_rows, self.inputs.eval_rows

    def _resume(self) -> None:
        from inference.game import QuestionPool
        from training import checkpoint as C

        path = self.resume_from  # found (and checked) before the model was built
        if path is None:
            return
        state = C.load(self.actor, path, extra={"critic": self.critic} if self.critic is not None else None)
        self.step, self.cursor, self.qa_cursor = int(state["step"]), int(state["cursor"]), int(state.get("qa_cursor", 0))
        self.ema_state = state.get("ema_state", {})
        if "guards" in state:
            self.failures.load_state_dict(state["guards"]["failures"])
            self.nonfinite.load_state_dict(state["guards"]["nonfinite"])
        self.pool = QuestionPool.from_list(state.get("pool", []), self.cfg.selfplay.pool_size,
                                           seed=self.cfg.optimisation.seed + self.dp_rank)
        if "pool_rng" in state:
            self.pool.rng.setstate(state["pool_rng"])
        if self.simulated is not None and state.get("curriculum"):
            self.simulated.load_state_dict(state["curriculum"])
        print0(f"resumed from {path} at step {self.step}")

    def save(self) -> None:
        from training import checkpoint as C
        ck = self.cfg.checkpointing
        path = C.save(self.actor, self.out, self.step,
               {"cursor": self.cursor, "qa_cursor": self.qa_cursor, "pool": self.pool.to_list(), "pool_rng": self.pool.rng.getstate(),
                "ema_state": self.ema_state,
                "guards": {"failures": self.failures.state_dict(), "nonfinite": self.nonfinite.state_dict()},
                "curriculum": self.simulated.state_dict() if self.simulated is not None else {}},
               tokenizer_dir=self.cfg.model.model_path, export=ck.export_hf, max_ckpts=ck.max_ckpts,
               extra={"critic": self.critic} if self.critic is not None else None)
        if self.critic is not None and self.cfg.critic.export_critic:  # optional: not needed to resume
            C.export_hf(self.critic.module, self.cfg.model.model_path, path / "critic_hf")

    # ------------------------------------------------------------------ data
    def next_batch(self) -> tuple[list, list[dict]]:
        """This data-parallel group's share of the next global batch: proposer rows and fixed QA
        questions (Search-R1 data, self-play off or mixed in). Each source is read in a fixed
        permutation per epoch, so the cursors alone restore the order on resume."""
        sp = self.cfg.selfplay
        b = sp.prompts_per_step
        n_qa = b if not sp.self_play_enable else int(round(sp.qa_mix_fraction * b))
        start, prop = self.cursor, self._take(self.rows, "cursor", b - n_qa)
        prop = mix_search_turns(prop, start, sp.search_turns_mix, self.cfg.optimisation.seed, sp.min_searches,
                                self.cfg.rollout.max_turns - 1)  # --search_turns_mix: n by (seed, position); "" = off
        self.batch_search_turns = [r.search_turns for r in prop]  # the whole batch's, the same on every rank
        items = [("p", r) for r in prop]
        items += [("q", r) for r in self._take(self.qa_rows, "qa_cursor", n_qa)]
        per = b // self.dp_world
        mine = items[self.dp_rank * per:(self.dp_rank + 1) * per]
        return ([r for k, r in mine if k == "p"],
                [{"question": r.question, "answer": r.golden_answers} for k, r in mine if k == "q"])

    def _take(self, rows: list, cursor: str, k: int) -> list:
        start, n = getattr(self, cursor), len(rows)
        out = []
        for g in range(start, start + k):
            epoch, i = divmod(g, n)
            out.append(rows[int(np.random.default_rng(self.cfg.optimisation.seed + epoch).permutation(n)[i])])
        setattr(self, cursor, start + k)
        return out

    def trained_roles(self) -> set[str]:
        """Roles whose trajectories carry loss this step (the others still play)."""
        sp = self.cfg.selfplay
        roles = {"proposer"} if sp.proposer_enable and sp.self_play_enable else set()
        if sp.solver_enable and self.step >= sp.proposer_warm_up_steps:
            roles.add("solver")
        return roles

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        from tqdm import tqdm
        cfg = self.cfg
        bar = tqdm(total=cfg.optimisation.total_steps, initial=self.step, desc="ssp", unit="step",
                   disable=not D.is_main())
        while self.step < cfg.optimisation.total_steps:
            metrics = self.train_step()
            self.step += 1
            bar.update(1)
            if self.step % cfg.logging.log_every == 0:
                self.log.scalars(self.step, metrics)
                bar.set_postfix_str(fmt_metrics(metrics, ["proposer/reward_mean", "solver/acc", "game/valid_rate",
                                                          "actor/pg_loss", "timing_s/step"]))
            every = cfg.checkpointing.save_every
            if (every and self.step % every == 0) or self.step == cfg.optimisation.total_steps:
                self.save()
            ev = cfg.eval.eval_every
            if self.eval_rows and ((ev and self.step % ev == 0) or self.step == cfg.optimisation.total_steps):
                self.evaluate()
        bar.close()
        self.log.close()

    @contextmanager
    def _timer(self, times: dict, key: str):
        t0 = time.perf_counter()
        yield
        times[f"timing_s/{key}"] = times.get(f"timing_s/{key}", 0.0) + time.perf_counter() - t0

    def play(self, rollout_cfg: dict):
        """The step's game: one round on the next rows, or with --min_informative_groups N more rounds on the rows
        after them until the step holds N informative solver groups (or --max_rounds): training/rounds.py."""
        from inference.game import play_round, signal_counts
        from inference.self_search import shape_solver_rewards
        search_fns = {role: (s.search if s is not None else None) for role, s in self.search.items()}
        n, turns = self.cfg.algorithm.min_informative_groups, []

        def one(k: int):
            rows, qa = self.next_batch()
            turns.extend(self.batch_search_turns)
            game = play_round(self.llm, rows, search_fns, self.judge, self.game_cfg, round_rollout_cfg(rollout_cfg, k),
                              pool=self.pool, step=self.step, qa_questions=qa, round_idx=k)
            if self.cfg.search.self_search_format_reward:  # before the count: shaping decides which groups are flat
                shape_solver_rewards(game.trajectories, self.game_cfg.spam_divisor)
                game.stats.update(signal_counts([t for t in game.trajectories if t.role == "solver"]))
            return game
        rounds = play_rounds(one, n, self.cfg.algorithm.max_rounds,  # a TP group's ranks play the same games: once
                             lambda x: D.all_reduce_sum([x])[0] / self.cfg.rollout.vllm_tp)
        game = merge_rounds(rounds, main=D.is_main()) if n else rounds[0]
        if self.cfg.selfplay.search_turns_mix and turns:  # the same on every rank: a mean over ranks keeps it
            game.stats["proposer/search_turns_mean"] = float(np.mean(turns))
        return game

    def train_step(self) -> dict:
        from inference.game import pool_clear_due, shares
        from inference.rollout import RolloutConfig

        cfg, times = self.cfg, {}
        t_step = time.perf_counter()
        with self._timer(times, "sync"):
            sync = self.hybrid.to_generate()
        for s in self.search.values():
            if s is not None:
                s.reset()
        r = cfg.rollout
        rollout_cfg = {role: RolloutConfig(
            max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, max_tokens_per_turn=r.max_tokens_per_turn,
            max_info_tokens=r.max_info_tokens, topk=cfg.search.topk, temperature=r.temperature, top_p=r.top_p,
            seed=cfg.optimisation.seed * 1_000_003 + self.step * 1009 + self.dp_rank,
            self_search=getattr(cfg.search, f"{role}_search") == "self", progress=D.is_main())
            for role in ("proposer", "solver")}
        if self.simulated is not None:
            self.simulated.set_step(self.step)
            sim_before = dict(self.simulated.stats)
        # --pool_clear_every: a function of the step and the checkpointed pool, so ranks and a resumed run agree
        cleared = self.pool.clear_admitted() if pool_clear_due(self.step, self.game_cfg.pool_clear_every) else 0
        with self._timer(times, "generate"):
            game = self.play(rollout_cfg)
        game.stats["game/pool_cleared"] = cleared  # a count (inference.game.COUNT_KEYS): summed over ranks
        _fault_point("after_generate", self.step)
        self.hybrid.to_train()
        game_stats = self._reduce_game_stats(game.stats)
        game_stats.update(shares(game_stats))  # informative share, solve rates, question kinds: from global counts
        # Groups whose judging or search failed (inference/game.mark_excluded) never reach the loss;
        # past --max_failed_share of them over the window the run stops here, on every rank alike
        # (the counts are global), before it trains on the biased remainder.
        self.failures.update(game_stats.get("game/excluded_groups", 0.0), game_stats.get("game/groups", 0.0),
                             {k.rsplit("/", 1)[1]: v for k, v in game_stats.items() if k.startswith("game/excluded/")})
        roles = self.trained_roles()
        trajs = [t for t in game.trajectories
                 if t.num_sampled > 0 and t.role in roles and not t.info.get("excluded")]
        if cfg.algorithm.drop_flat_solver_groups:
            trajs, n_flat = drop_flat_solver_groups(trajs)
            game_stats.update(self._mean_over_ranks({"game/flat_solver_groups": float(n_flat)}))

        with self._timer(times, "logprobs"):
            if cfg.algorithm.old_logprobs == "rollout":  # vLLM's raw log-probs, validated to be the policy's
                old = [torch.tensor(t.logprobs, dtype=torch.float32) for t in trajs]
            else:
                old = self.forward_logprobs(self.actor, trajs)
            ref = self.forward_logprobs(self.engines.ref, trajs) if self.engines.ref is not None else None
        values = None
        if self.critic is not None:
            with self._timer(times, "critic"):
                values = step_values(self.critic, trajs, cfg.algorithm, cfg.optimisation.micro_token_budget)
        adv, returns = self.advantages(trajs, values, old, ref)
        distill, term = {}, None
        if cfg.algorithm.distill != "off":   # the teacher's dense term: in the advantages, or the loss (topk)
            with self._timer(times, "teacher"):
                adv, distill, term = self._distill(trajs, adv, old, game.trajectories)
        gap = self._rollout_lp_gap(trajs, old)
        with self._timer(times, "update"):
            upd = {}
            if self.critic is None or self.step >= cfg.critic.critic_warmup:  # --critic_warmup: the critic alone
                set_lr(self.actor, cfg, self.step)
                snap = snapshot_weights(self.actor)
                upd = self.update(trajs, adv, old, ref, term)
                upd["actor/weights_changed_frac"] = changed_fraction(self.actor, snap)
        if self.critic is not None:
            with self._timer(times, "critic"):
                upd.update(train_step_critic(self.critic, cfg, self.step, trajs, values, returns, self._mean_over_ranks))
        upd["actor/rollout_lp_gap"] = gap
        # a step with a skipped optimizer step counts as non-finite; N in a row stop the run (all ranks:
        # the count is the same everywhere)
        self.nonfinite.update(upd.get("actor/skipped_steps", 0.0) > 0, what="loss inputs, log-probs or gradient norm")
        _fault_point("after_update", self.step)

        metrics = {**game_stats, **upd, **sync, **distill}
        metrics.update(self._rollout_metrics(game.trajectories))
        metrics.update(self._mean_over_ranks({f"train/{role}_tokens": float(sum(t.num_sampled for t in trajs if t.role == role))
                                              for role in ("proposer", "solver")}))  # summed: SUM_KEYS
        for role, s in self.search.items():
            if s is not None:
                metrics[f"timing_s/search_{role}"] = s.seconds
        if self.simulated is not None:
            st = {k: self.simulated.stats[k] - sim_before.get(k, 0) for k in self.simulated.stats}
            metrics.update(self._mean_over_ranks({"search/sim_noise_p": self.simulated.noise_p,
                                                  "search/sim_noisy_frac": st["noisy"] / max(st["docs"], 1),
                                                  "search/sim_failures": float(st["failures"]),
                                                  "search/sim_docs": float(st["docs"])}))
        times["timing_s/step"] = time.perf_counter() - t_step
        metrics.update({k: D.all_reduce_max(v) for k, v in sorted(times.items())})
        if cfg.logging.sample_every and (self.step + 1) % cfg.logging.sample_every == 0:
            self._dump_samples(game.trajectories)
        if cfg.logging.dump_rollouts:
            from inference.game import rollout_record
            from utils.logging import write_jsonl_atomic
            write_jsonl_atomic(self.out / "rollouts" / f"step_{self.step + 1}.rank{self.rank}.jsonl",
                        [rollout_record(t) for t in game.trajectories])
        return metrics

    # ------------------------------------------------------------------ log-probs, advantages, update
    @torch.no_grad()
    def forward_logprobs(self, engine, trajs) -> list[torch.Tensor]:
        """Per-token log-probs of each trajectory under `engine` (actor before the update, or the reference)."""
        from training.packing import unpack_to_sequences
        from training.update import engine_logprobs, pack_equal
        was_training = engine.module.training
        engine.module.eval()
        mbs, n_real = pack_equal(trajs, self.cfg.optimisation.micro_token_budget)
        outs = [engine_logprobs(engine, mb, self.cfg.rollout.temperature)[0].float().cpu() for mb in mbs]
        engine.module.train(was_training)
        return unpack_to_sequences(mbs[:n_real], outs[:n_real], len(trajs)) if trajs else []

    def _rollout_lp_gap(self, trajs, old, sample: int = 4) -> float:
        """Mean |vLLM's sampled-token log-prob - the actor's| over the step's sampled tokens: near 0
        when the weight sync and the two engines agree. With --old_logprobs rollout, `old` *is* vLLM's,
        so the actor re-scores a few trajectories per rank (one small forward; collective)."""
        if self.cfg.algorithm.old_logprobs == "rollout":
            trajs = trajs[:sample]
            old = self.forward_logprobs(self.actor, trajs)
        num = den = 0.0
        for t, lp in zip(trajs, old):
            m = torch.tensor(t.loss_mask, dtype=torch.bool)
            num += float((torch.tensor(t.logprobs)[m] - lp[m]).abs().sum())
            den += float(m.sum())
        num, den = D.all_reduce_sum([num, den])
        return num / den if den else 0.0

    def advantages(self, trajs, values=None, old=None, ref=None) -> tuple[list, list]:
        """(advantages, critic targets or None) per trajectory: training.advantages.role_advantages."""
        from training.advantages import role_advantages
        adv, returns, self.ema_state = role_advantages(
            trajs, self.cfg.algorithm, self.cfg.critic, state=self.ema_state, values=values, old=old, ref=ref,
            all_reduce=_all_reduce_tensor)
        return adv, returns

    def _distill(self, trajs, adv, old, played=None) -> tuple[list[torch.Tensor], dict, object]:
        """Self-distillation (training/teacher.py dense_term): the teacher scores the solver's own tokens under a
        privileged prompt. sampled: its log-probs join the advantages with this step's beta; contrast: so does
        their gap to the teacher under another question's path (training/contrast.py); topk: its top-K make the
        loss term (TopKTerm) that ppo_update adds, and the advantages stay."""
        from training.distill import beta_at
        from training.self_distill import dense_term
        from training.teacher import finish_metrics, forward_topk
        a, temp = self.cfg.algorithm, self.cfg.rollout.temperature
        beta = beta_at(self.step, self.cfg.optimisation.total_steps, a.distill_coef, a.distill_schedule,
                       a.distill_coef_floor)
        engine = self.engines.ref if a.distill_teacher == "reference" else self.actor
        fwd = ((lambda seqs: forward_topk(engine, seqs, a.distill_topk, temp, self.cfg.optimisation.micro_token_budget))
               if a.distill == "topk" else (lambda seqs: self.forward_logprobs(engine, seqs)))
        adv, sums, term = dense_term(trajs, adv, old, beta, fwd, self.tokenizer, self.cfg, self.pool.items, self.step,
                                     played)
        keys = sorted(sums)
        return adv, finish_metrics(dict(zip(keys, D.all_reduce_sum([sums[k] for k in keys]))), beta), term

    def update(self, trajs, adv, old, ref, distill=None) -> dict:
        from training.update import ppo_update

        o = self.cfg.optimisation
        metrics, n_steps, n_skipped = ppo_update(
            self.actor, trajs, adv, old, ref, self.cfg.algorithm, temperature=self.cfg.rollout.temperature,
            micro_token_budget=o.micro_token_budget, seed=o.seed * 7 + self.step, distill=distill)
        out = dict(metrics)  # per optimizer step means, tokens once (training.update.reduce_step_metrics)
        gn = self.actor.get_global_grad_norm() if n_steps else None
        if gn is not None:
            out["actor/grad_norm"] = float(gn)  # DeepSpeed's, of the last optimizer step it ran (inf: it skipped it)
        out["actor/optimizer_steps"] = float(n_steps)
        out["actor/skipped_steps"] = float(n_skipped)
        out["actor/lr"] = float(self.actor.get_lr()[0])
        return self._mean_over_ranks(out)

    # ------------------------------------------------------------------ metrics, samples, eval
    def _mean_over_ranks(self, m: dict) -> dict:
        keys = sorted(set().union(*D.all_gather_object(sorted(m))))
        vals = D.all_reduce_sum([m.get(k, 0.0) for k in keys] + [float(k in m) for k in keys])
        n = len(keys)
        return {k: (vals[i] if k.endswith("_loss") or k in SUM_KEYS or is_count(k) else vals[i] / max(vals[n + i], 1.0))
                for i, k in enumerate(keys)}

    def _reduce_game_stats(self, stats: dict) -> dict:
        return self._mean_over_ranks({k: float(v) for k, v in stats.items() if isinstance(v, (int, float))})

    def _rollout_metrics(self, trajs) -> dict:
        m = {}
        sols = [t for t in trajs if t.role == "solver"]
        if sols:  # the rewards the loss sees (after any shaping), beside the correctness they came from
            m["train/solver_reward_mean"] = float(np.mean([t.reward for t in sols]))
            m["train/solver_correct_mean"] = float(np.mean([float(t.info.get("correct", 0.0)) for t in sols]))
            if self.cfg.search.self_search_format_reward:
                m["search/self_format_reward"] = float(np.mean([t.info["format_reward"] for t in sols]))
        for role in ("proposer", "solver"):
            sub = [t for t in trajs if t.role == role]
            if sub:
                m[f"rollout/{role}_turns_mean"] = float(np.mean([t.num_turns for t in sub]))
                m[f"rollout/{role}_response_tokens_mean"] = float(np.mean([t.num_sampled for t in sub]))
                m[f"search/{role}_calls_per_traj"] = float(np.mean([t.num_searches for t in sub]))
                m[f"rollout/{role}_trajs"] = float(len(sub))
        for s in self.search.values():
            if s is not None:
                m["search/calls"] = m.get("search/calls", 0) + s.calls
                m["search/queries"] = m.get("search/queries", 0) + s.queries
                m["search/failures"] = m.get("search/failures", 0) + s.failures
        return self._mean_over_ranks(m)

    def _dump_samples(self, trajs) -> None:
        for role in ("proposer", "solver"):
            for t in [t for t in trajs if t.role == role][:2]:
                text = self.tokenizer.decode(t.token_ids)
                self.log.text(self.step + 1, f"samples/{role}",
                              f"reward={t.reward:.3f} turns={t.num_turns} searches={t.num_searches} "
                              f"stop={t.stop_reason} answer={t.answer!r}\n{text}"
                              + (f"\n--- teacher's privileged context ---\n{t.info['teacher_context']}"
                                 if t.info.get("teacher_context") else ""))

    def evaluate(self) -> dict:
        """Held-out solver eval with inference/evaluate.py (eval.py's loop) on this rank's rows; results all-reduced."""
        from inference.evaluate import EvalConfig, evaluate
        from inference.rollout import RolloutConfig
        r = self.cfg.rollout
        self.hybrid.to_generate()
        rows = self.eval_rows[self.dp_rank::self.dp_world]
        ecfg = EvalConfig(rollout=RolloutConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                                                max_tokens_per_turn=r.max_tokens_per_turn, max_info_tokens=r.max_info_tokens,
                                                topk=self.cfg.search.topk, temperature=0.0),
                          template=self.cfg.model.template, judge=self.judge, progress=D.is_main())
        s = self.search["solver"]
        res = evaluate(self.llm, rows, s.search if s is not None else None, ecfg) if rows else {"examples": []}
        ex = res["examples"]
        sums = D.all_reduce_sum([len(ex), sum(e["em"] for e in ex), sum(e["f1"] for e in ex),
                                 sum(float(e["judge_correct"]) for e in ex)])
        n = max(sums[0], 1.0)
        m = {"eval/n": sums[0], "eval/em": sums[1] / n, "eval/f1": sums[2] / n, "eval/judge_acc": sums[3] / n}
        self.log.scalars(self.step, m)
        print0(f"eval @ step {self.step}: " + fmt_metrics(m, list(m)))
        return m


def _all_reduce_tensor(t: torch.Tensor) -> None:
    D.all_reduce_tensor(t, "sum")  # utils.dist puts it on the backend's device (NCCL: CUDA only)


def _fault_point(where: str, step: int) -> None:
    """Crash injection for the resume test: SSP_FAULT=after_generate:3 kills the process (no
    clean-up, like a node failure) when step 3 reaches that point (training.checkpoint.fault_point)."""
    from training.checkpoint import fault_point
    fault_point(where, step)
