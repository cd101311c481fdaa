"""The SSP step loop. Every rank runs the same program (SPMD):

    for step in steps:
        sync  = hybrid.to_generate()               # ZeRO-3 shards -> vLLM, prefix cache reset
        game  = play(rows of this rank)            # proposer -> filters -> RAG -> solver -> rewards (the game
                                                   # scores itself, inference/game.py; more rounds: training/loop/rounds.py)
        hybrid.to_train()                          # vLLM sleeps (GPU)
        stats = game's counts summed over ranks    # shares, the failure guard
        trajs = trajectories that carry loss       # trained roles, no excluded or flat group
        learn(trajs)                               # packed once (training/algorithm/step_batch.py): old/ref log-probs,
                                                   # values (gae roles), advantages per role, update (clipped
                                                   # surrogate, global normaliser), the critic's
        log, checkpoint, evaluate

Set-up (the config once the world is known, engines, the game's settings) is training/engine/setup.py; the search
tools training/loop/search.py; the simulated-search curriculum training/loop/curriculum.py. A metric is summed over ranks
where the module that makes it says so (utils/metrics.py), else averaged.

A question's whole solver group stays on the rank that played it, so group
advantages are local; batch-wide statistics and the loss normaliser are all-reduced.
Every collective (ZeRO-3 forwards, GatheredParameters, all-reduces) is called the same
number of times on every rank: micro-batch counts are equalised with empty work.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from inference.data import mix_search_turns
from inference.evaluate import EvalConfig, evaluate
from inference.game import QuestionPool, play_round, pool_clear_due, rollout_record, shares
from inference.step_loop import first_rank_value
from training.engine import checkpoint as C
from training.loop import search as S
from training.algorithm.advantages import role_advantages
from training.settings.config import Config
from training.algorithm.critic import step_values, train_step_critic
from training.loop.curriculum import SimCurriculum
from training.algorithm.distill import beta_at
from training.engine.guards import FailureGuard, NonFiniteGuard
from training.engine.hf_export import export_hf
from training.algorithm.lr_schedule import set_lr
from training.engine.hybrid import HybridEngine
from training.settings.preflight import preflight
from training.loop.rounds import drop_flat_solver_groups, merge_rounds, play_rounds, round_rollout_cfg
from training.engine.run_folder import prepare_output_dir
from training.engine.run_state import find_resume
from training.algorithm.self_distill import dense_term
from training.engine.setup import (build_judge, build_models, eval_rollout_config, game_config, resolve_config,
                            rollout_configs, seeded_pool, training_rows)
from training.algorithm.step_batch import OLD, REF, StepBatch
from training.algorithm.teacher import finish_metrics, forward_topk
from training.algorithm.micro_batches import engine_logprobs
from training.algorithm.update import changed_fraction, ppo_update, snapshot_weights
from utils import dist as D
from utils.logging import RunLogger, fmt_metrics, print0, write_jsonl_atomic
from utils.metrics import reduce_over_ranks, set_replicas, summed


class SSPTrainer:
    def __init__(self, cfg: Config, inputs=None):
        """`inputs`: train.py's preflight (training/settings/preflight.py), read before the process group; None reads them here."""
        D.init_distributed()
        resolve_config(cfg)  # --prompts_per_step 0 (auto), defaults and validate_args, now that the world is known
        self.cfg = cfg
        self.rank, self.world = D.rank(), D.world_size()
        self.out = Path(cfg.logging.output_dir)
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
        o = cfg.optimisation
        self.failures = FailureGuard(o.max_failed_share, o.failed_share_window)
        self.nonfinite = NonFiniteGuard(o.max_nonfinite_steps)
        self._resume()

    # ------------------------------------------------------------------ set-up (training/engine/setup.py)
    def _build(self) -> None:
        cfg, tp = self.cfg, self.cfg.rollout.vllm_tp
        # With TP > 1 every rank of a TP group must send identical prompts, so the group shares a seed
        # and a data shard (the rank's share is by TP group, not by rank).
        self.dp_rank, self.dp_world = self.rank // tp, self.world // tp
        set_replicas(tp)  # so a count summed over ranks counts each of those games once (utils/metrics.py)
        self.llm, self.engines = build_models(cfg, self.rank, self.dp_rank, self.world)
        self.actor, self.critic = self.engines.actor, self.engines.critic
        self.tokenizer = self.llm.tokenizer
        self.hybrid = HybridEngine(self.actor, self.llm, bucket_mb=cfg.rollout.sync_bucket_mb)
        self.search, simulated = S.build_searches(cfg, self.llm, seed=cfg.optimisation.seed + self.dp_rank)
        self.curriculum = SimCurriculum(simulated)
        self.judge = build_judge(cfg, self.out)
        self.game_cfg = game_config(cfg, self.dp_rank)
        self.pool = seeded_pool(cfg, self.inputs.pool_rows, self.dp_rank)
        self.rows = training_rows(cfg, self.inputs.rows)
        self.qa_rows, self.eval_rows = self.inputs.qa_rows, self.inputs.eval_rows

    def _resume(self) -> None:
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
        self.curriculum.load_state_dict(state.get("curriculum") or {})
        print0(f"resumed from {path} at step {self.step}")

    def save(self) -> None:
        ck = self.cfg.checkpointing
        path = C.save(self.actor, self.out, self.step,
               {"cursor": self.cursor, "qa_cursor": self.qa_cursor, "pool": self.pool.to_list(), "pool_rng": self.pool.rng.getstate(),
                "ema_state": self.ema_state,
                "guards": {"failures": self.failures.state_dict(), "nonfinite": self.nonfinite.state_dict()},
                "curriculum": self.curriculum.state_dict()},
               tokenizer_dir=self.cfg.model.model_path, export=ck.export_hf, max_ckpts=ck.max_ckpts,
               extra={"critic": self.critic} if self.critic is not None else None)
        if self.critic is not None and self.cfg.critic.export_critic:  # optional: not needed to resume
            export_hf(self.critic.module, self.cfg.model.model_path, path / "critic_hf")

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
        after them until the step holds N informative solver groups (or --max_rounds): training/loop/rounds.py."""
        search_fns = {role: (s.search if s is not None else None) for role, s in self.search.items()}
        n, turns = self.cfg.algorithm.min_informative_groups, []

        def one(k: int):
            rows, qa = self.next_batch()
            turns.extend(self.batch_search_turns)
            return play_round(self.llm, rows, search_fns, self.judge, self.game_cfg, round_rollout_cfg(rollout_cfg, k),
                              pool=self.pool, step=self.step, qa_questions=qa, round_idx=k)
        rounds = play_rounds(one, n, self.cfg.algorithm.max_rounds,  # a TP group's ranks play the same games: once
                             lambda x: D.all_reduce_sum([x])[0] / self.cfg.rollout.vllm_tp)
        game = merge_rounds(rounds) if n else rounds[0]
        if self.cfg.selfplay.search_turns_mix and turns:  # the same on every rank: a mean over ranks keeps it
            game.stats["proposer/search_turns_mean"] = float(np.mean(turns))
        return game

    def train_step(self) -> dict:
        """One SSP step: play (the game scores itself), learn from the trajectories that carry loss, log."""
        times, t_step = {}, time.perf_counter()
        with self._timer(times, "sync"):
            sync = self.hybrid.to_generate()
        game = self.play_step(times)                                  # play; the game scores itself
        self.hybrid.to_train()
        stats = self.game_stats(game)                                 # its counts over ranks, the failure guard
        trajs = self.trainable(game.trajectories, stats)
        upd, distill = self.learn(trajs, game.trajectories, times)    # learn
        metrics = {**stats, **upd, **sync, **distill, **self.step_metrics(game.trajectories, trajs)}  # log
        times["timing_s/step"] = time.perf_counter() - t_step
        metrics.update({k: D.all_reduce_max(v) for k, v in sorted(times.items())})
        self.write_samples(game.trajectories)
        return metrics

    def play_step(self, times: dict):
        """This rank's games of the step, scored; the pool cleared first when --pool_clear_every is due."""
        S.reset(self.search)
        self.curriculum.start(self.step)
        # --pool_clear_every: a function of the step and the checkpointed pool, so ranks and a resumed run agree
        cleared = self.pool.clear_admitted() if pool_clear_due(self.step, self.game_cfg.pool_clear_every) else 0
        C.kill_in_round(self.step)  # SSP_FAULT=kill_in_round:<step>:<s>, bench/bench_faults.py
        with self._timer(times, "generate"):
            game = self.play(rollout_configs(self.cfg, self.step, self.dp_rank))
        game.stats["game/pool_cleared"] = cleared  # a count (inference.game.COUNT_KEYS): summed over ranks
        _fault_point("after_generate", self.step)
        return game

    def game_stats(self, game) -> dict:
        """The game's stats over ranks (counts summed), the shares read off the global counts, and the
        failure guard's update."""
        stats = reduce_over_ranks({k: float(v) for k, v in game.stats.items() if isinstance(v, (int, float))})
        stats.update(shares(stats))  # informative share, solve rates, question kinds: from global counts
        # Groups whose judging or search failed (inference/game.mark_excluded) never reach the loss;
        # past --max_failed_share of them over the window the run stops here, on every rank alike
        # (the counts are global), before it trains on the biased remainder.
        self.failures.update(stats.get("game/excluded_groups", 0.0), stats.get("game/groups", 0.0),
                             {k.rsplit("/", 1)[1]: v for k, v in stats.items() if k.startswith("game/excluded/")})
        return stats

    def trainable(self, played: list, stats: dict) -> list:
        """The trajectories that carry loss this step: sampled tokens, a trained role, not left out; without the
        flat solver groups under --drop_flat_solver_groups (their count joins `stats`)."""
        roles = self.trained_roles()
        trajs = [t for t in played if t.num_sampled > 0 and t.role in roles and not t.outcome.excluded]
        if self.cfg.algorithm.drop_flat_solver_groups:
            trajs, n_flat = drop_flat_solver_groups(trajs)
            stats.update(reduce_over_ranks({"game/flat_solver_groups": float(n_flat)}))
        return trajs

    def learn(self, trajs: list, played: list, times: dict) -> tuple[dict, dict]:
        """Log-probs, values, advantages, the actor's update and the critic's: (update metrics, distill metrics)."""
        cfg = self.cfg
        batch = StepBatch(trajs, cfg.optimisation.micro_token_budget)   # packed once, on first use (training/algorithm/step_batch.py)
        with self._timer(times, "logprobs"):
            if cfg.algorithm.old_logprobs == "rollout":  # vLLM's raw log-probs, validated to be the policy's
                old = [torch.tensor(t.logprobs, dtype=torch.float32) for t in trajs]
            else:
                old = self.forward_logprobs(self.actor, batch, OLD)
            ref = self.forward_logprobs(self.engines.ref, batch, REF) if self.engines.ref is not None else None
        values = None
        if self.critic is not None:
            with self._timer(times, "critic"):
                values = step_values(self.critic, trajs, cfg.algorithm, cfg.optimisation.micro_token_budget, batch)
        adv, returns = self.advantages(trajs, values, old, ref)
        distill, term = {}, None
        if cfg.distill.distill != "off":   # the teacher's dense term: in the advantages, or the loss (topk)
            with self._timer(times, "teacher"):
                adv, distill, term = self._distill(trajs, adv, old, played)
        gap = self._rollout_lp_gap(trajs, old)
        with self._timer(times, "update"):
            upd = {}
            if self.critic is None or self.step >= cfg.critic.critic_warmup:  # --critic_warmup: the critic alone
                set_lr(self.actor, cfg, self.step)
                snap = snapshot_weights(self.actor)
                upd = self.update(trajs, adv, old, ref, term, batch)
                upd["actor/weights_changed_frac"] = changed_fraction(self.actor, snap)
        if self.critic is not None:
            with self._timer(times, "critic"):
                upd.update(train_step_critic(self.critic, cfg, self.step, trajs, values, returns, reduce_over_ranks,
                                             batch))
        times["timing_s/pack"] = batch.pack_seconds   # within the phases' times above (the teacher's packing aside)
        upd["actor/rollout_lp_gap"] = gap
        # a step with a skipped optimizer step counts as non-finite; N in a row stop the run (all ranks:
        # the count is the same everywhere)
        self.nonfinite.update_skipped(upd)
        _fault_point("after_update", self.step)
        return upd, distill

    # ------------------------------------------------------------------ log-probs, advantages, update
    @torch.no_grad()
    def forward_logprobs(self, engine, trajs, column: str = OLD) -> list[torch.Tensor]:
        """Per-token log-probs of each trajectory under `engine` (actor before the update, or the reference).
        trajs: a list (packed here), or the step's StepBatch, whose micro-batches are reused and whose
        `column` receives the packed log-probs."""
        batch = trajs if isinstance(trajs, StepBatch) else StepBatch(trajs, self.cfg.optimisation.micro_token_budget)
        was_training = engine.module.training
        engine.module.eval()
        batch.put_packed(column, [engine_logprobs(engine, mb, self.cfg.rollout.temperature)[0].float().cpu()
                                  for mb in batch.micro_batches])
        engine.module.train(was_training)
        return batch.column(column)

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
        """(advantages, critic targets or None) per trajectory: training.algorithm.advantages.role_advantages."""
        adv, returns, self.ema_state = role_advantages(
            trajs, self.cfg.algorithm, self.cfg.critic, state=self.ema_state, values=values, old=old, ref=ref,
            all_reduce=_all_reduce_tensor)
        return adv, returns

    def _distill(self, trajs, adv, old, played=None) -> tuple[list[torch.Tensor], dict, object]:
        """Self-distillation (training/algorithm/self_distill.py dense_term): the teacher scores the solver's own tokens under a
        privileged prompt. sampled: its log-probs join the advantages with this step's beta; contrast: so does
        their gap to the teacher under another question's path (training/algorithm/contrast.py); topk: its top-K make the
        loss term (TopKTerm) that ppo_update adds, and the advantages stay."""
        a, temp = self.cfg.distill, self.cfg.rollout.temperature
        beta = beta_at(self.step, self.cfg.optimisation.total_steps, a.distill_coef, a.distill_schedule,
                       a.distill_coef_floor)
        engine = self.engines.ref if a.distill_teacher == "reference" else self.actor
        fwd = ((lambda seqs: forward_topk(engine, seqs, a.distill_topk, temp, self.cfg.optimisation.micro_token_budget))
               if a.distill == "topk" else (lambda seqs: self.forward_logprobs(engine, seqs)))
        adv, sums, term = dense_term(trajs, adv, old, beta, fwd, self.tokenizer, self.cfg, self.pool.items, self.step,
                                     played)
        keys = sorted(sums)
        return adv, finish_metrics(dict(zip(keys, D.all_reduce_sum([sums[k] for k in keys]))), beta), term

    def update(self, trajs, adv, old, ref, distill=None, batch=None) -> dict:
        """ppo_update on the step's batch: its old/ref columns reused, the advantages scattered into it once."""
        o = self.cfg.optimisation
        metrics, n_steps, n_skipped = ppo_update(
            self.actor, trajs, adv, old, ref, self.cfg.algorithm, temperature=self.cfg.rollout.temperature,
            micro_token_budget=o.micro_token_budget, seed=o.seed * 7 + self.step, distill=distill, batch=batch)
        out = dict(metrics)  # per optimizer step means, tokens once (training.algorithm.update.reduce_step_metrics)
        gn = self.actor.get_global_grad_norm() if n_steps else None
        if gn is not None:
            out["actor/grad_norm"] = float(gn)  # DeepSpeed's, of the last optimizer step it ran (inf: it skipped it)
        out["actor/optimizer_steps"] = float(n_steps)
        out["actor/skipped_steps"] = float(n_skipped)
        out["actor/lr"] = float(self.actor.get_lr()[0])
        return reduce_over_ranks(out)

    # ------------------------------------------------------------------ metrics, samples, eval
    def step_metrics(self, played: list, trajs: list) -> dict:
        """The step's rollout, token, search and curriculum metrics, reduced over ranks (collective)."""
        # Only a TP group's first rank calls the search, under either schedule (inference/step_loop.py):
        # the group reports its counts, so each rank's line reads the group's games, as the replicas assume.
        counts, seconds = first_rank_value(self.llm, lambda: (S.search_counts(self.search),
                                                              S.search_seconds(self.search)))
        m = reduce_over_ranks({**rollout_metrics(played, self.cfg.search.self_search_format_reward), **counts})
        m.update(reduce_over_ranks(trained_tokens(trajs)))
        m.update(seconds)
        if self.curriculum.backend is not None:
            m.update(reduce_over_ranks(self.curriculum.step_metrics()))
        return m

    def write_samples(self, played: list) -> None:
        """--sample_every: a few decoded games to the logger; --dump_rollouts: every trajectory as a JSON line."""
        cfg = self.cfg
        if cfg.logging.sample_every and (self.step + 1) % cfg.logging.sample_every == 0:
            self._dump_samples(played)
        if cfg.logging.dump_rollouts:
            write_jsonl_atomic(self.out / "rollouts" / f"step_{self.step + 1}.rank{self.rank}.jsonl",
                               [rollout_record(t) for t in played])

    def _dump_samples(self, trajs) -> None:
        for role in ("proposer", "solver"):
            for t in [t for t in trajs if t.role == role][:2]:
                text = self.tokenizer.decode(t.token_ids)
                self.log.text(self.step + 1, f"samples/{role}",
                              f"reward={t.reward:.3f} turns={t.num_turns} searches={t.num_searches} "
                              f"stop={t.stop_reason} answer={t.answer!r}\n{text}"
                              + (f"\n--- teacher's privileged context ---\n{t.teacher_context}"
                                 if t.teacher_context else ""))

    def evaluate(self) -> dict:
        """Held-out solver eval with inference/evaluate.py (eval.py's loop) on this rank's rows; results all-reduced."""
        self.hybrid.to_generate()
        rows = self.eval_rows[self.dp_rank::self.dp_world]
        ecfg = EvalConfig(rollout=eval_rollout_config(self.cfg), template=self.cfg.model.template, judge=self.judge,
                          progress=D.is_main())
        s = self.search["solver"]
        res = evaluate(self.llm, rows, s.search if s is not None else None, ecfg) if rows else {"examples": []}
        ex = res["examples"]
        sums = D.all_reduce_sum([len(ex), sum(e["em"] for e in ex), sum(e["f1"] for e in ex),
                                 sum(float(e["judge_correct"]) for e in ex)])
        n = max(sums[0], 1.0)  # a TP group's ranks evaluate the same rows: eval/n counts them once
        m = {"eval/n": sums[0] / self.cfg.rollout.vllm_tp, "eval/em": sums[1] / n, "eval/f1": sums[2] / n,
             "eval/judge_acc": sums[3] / n}
        self.log.scalars(self.step, m)
        print0(f"eval @ step {self.step}: " + fmt_metrics(m, list(m)))
        return m


def rollout_metrics(played: list, self_search_format_reward: bool = False) -> dict:
    """This rank's means over the step's trajectories: the rewards the loss sees (after any shaping) beside the
    correctness they came from, and per role the turns, sampled tokens, searches and trajectories."""
    m = {}
    sols = [t for t in played if t.role == "solver"]
    if sols:
        m["train/solver_reward_mean"] = float(np.mean([t.reward for t in sols]))
        m["train/solver_correct_mean"] = float(np.mean([float(t.outcome.correct or 0.0) for t in sols]))
        if self_search_format_reward:
            m["search/self_format_reward"] = float(np.mean([t.outcome.format_reward for t in sols]))
    for role in ("proposer", "solver"):
        sub = [t for t in played if t.role == role]
        if sub:
            m[f"rollout/{role}_turns_mean"] = float(np.mean([t.num_turns for t in sub]))
            m[f"rollout/{role}_response_tokens_mean"] = float(np.mean([t.num_sampled for t in sub]))
            m[f"search/{role}_calls_per_traj"] = float(np.mean([t.num_searches for t in sub]))
            m[f"rollout/{role}_trajs"] = float(len(sub))
    return m


summed("train/proposer_tokens", "train/solver_tokens")


def trained_tokens(trajs: list) -> dict:
    """This rank's sampled tokens that carry loss, per role (counts: summed over ranks, declared above)."""
    return {f"train/{role}_tokens": float(sum(t.num_sampled for t in trajs if t.role == role))
            for role in ("proposer", "solver")}


def _all_reduce_tensor(t: torch.Tensor) -> None:
    D.all_reduce_tensor(t, "sum")  # utils.dist puts it on the backend's device (NCCL: CUDA only)


def _fault_point(where: str, step: int) -> None:
    """Crash injection for the resume test: SSP_FAULT=after_generate:3 kills the process (no
    clean-up, like a node failure) when step 3 reaches that point (training.engine.checkpoint.fault_point)."""
    C.fault_point(where, step)
