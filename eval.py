"""Evaluate a search agent (the solver role) on QA sets: EM, F1, sub-EM and judge accuracy.

Launch lines:

    # the bundled sets, SmolLM2, the in-process BM25 index (what scripts/eval.sh runs)
    python eval.py --model data/models/SmolLM2-135M-Instruct --data data/eval/*.jsonl \\
        --index data/indexes/bm25 --out_dir runs/eval/smollm2

    # a training checkpoint's HF export, a retrieval server, an LLM judge server (scripts/start_judge.sh)
    python eval.py --model runs/x/hf/step_100 --data nq_test.parquet hotpotqa_dev.parquet \\
        --retriever_url http://127.0.0.1:8000 --judge_url http://127.0.0.1:8001 --out_dir runs/x/eval_100

    # a quick slice, no search tool, the HF reference engine
    python eval.py --model M --data d.jsonl --limit 20 --engine hf --out_dir /tmp/ev

Rows: JSONL or parquet with question, golden_answers, data_source (inference/data.py reads
Search-R1/FlashRAG rows too). Rollouts are greedy by default (temperature 0), one per
question, through the same multi-turn loop as training (inference/rollout.py), so numbers
measure the policy the trainer produces. Without --judge_url the judge column is exact
match (no server). Outputs in --out_dir: results.json (protocol + metrics), results.md
(the protocol, then a table per data source and overall), examples.jsonl (one line per
question), config.json (the flags); a folder that already holds any of them is refused
unless --overwrite is given. `evaluate()` is the reusable part: the trainer calls it for periodic eval.

Headroom (--samples K --temperature T): RL on a sampled policy mostly turns pass@k into
pass@1, so the SFT model's pass@K (a question counts if any of K samples is right) against
its greedy EM bounds what RL can gain. Each question is then rolled out K times, each its
own multi-turn rollout with its own seed, and every data source gains pass@K, mean@K (the
accuracy over all samples) and pass@k_unbiased (Chen et al. 2021, k = 1, 2, 4, .., K);
correct = the judge column. The other metrics become means over all samples, and each
examples.jsonl line holds its question's K predictions, verdicts, responses as lists.

    python eval.py --model runs/sft/hf --data data/eval/*.jsonl --index data/indexes/bm25 \\
        --samples 8 --temperature 1.0 --out_dir runs/eval/sft_pass8
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from inference.data import EvalRow, load_eval_rows
from inference.judge import Judge, JudgeItem
from inference.prompts import TEMPLATES, build_solver_prompt
from inference.self_search import build_self_search_prompt
from inference.rewards import extract_answer
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts
from utils.text import exact_match, f1_score, substring_match

METRICS = ("em", "f1", "sub_em", "judge_acc", "turns_mean", "searches_mean", "no_answer_rate")
# What main() writes into --out_dir. Any of them already there is refused without --overwrite; other
# files (scripts/eval.sh tees its eval.log there first, a --judge_cache may live there) are left alone.
OUTPUTS = ("results.json", "results.md", "examples.jsonl", "config.json")


@dataclass
class EvalConfig:
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=0.0))
    """Greedy by default: eval numbers should not depend on a sampling seed."""
    template: str = "auto"
    judge: Judge = field(default_factory=Judge)
    """Judge() = exact match only; Judge(url) adds the LLM judge for answers EM misses."""
    batch_size: int = 64
    """Rollouts per run_rollouts call (bounds memory; vLLM batches inside a call): batch_size // samples questions."""
    progress: bool = True
    samples: int = 1
    """Rollouts per question. 1 = today's metrics; K > 1 adds pass@K / mean@K and needs temperature > 0."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"EvalConfig.samples must be >= 1, got {self.samples}")
        if self.samples > 1 and self.rollout.temperature <= 0:
            raise ValueError(f"EvalConfig.samples={self.samples} with greedy rollouts (temperature 0) gives K "
                             "identical answers; set rollout.temperature > 0")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1): 1 - C(n-c,k)/C(n,k),
    the chance that k of the n samples drawn without replacement hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k reported by pass@k_unbiased: 1, 2, 4, .. below K, and K. With n = K samples the estimator at
    k = 1 is mean@K and at k = K is pass@K; the k between sketch the curve RL climbs."""
    return sorted({2 ** i for i in range(samples.bit_length()) if 2 ** i < samples} | {samples})


SAMPLE_FIELDS = ("pred", "em", "f1", "sub_em", "judge_correct", "judge_source", "judge_failed", "turns", "searches",
                 "stop_reason", "queries", "response")


def _sample_record(golden: list[str], t: Any, p: str | None, v: Any) -> dict:
    """One rollout's SAMPLE_FIELDS: its answer, scores and verdict."""
    return {
        "pred": p, "em": exact_match(p, golden), "f1": round(f1_score(p, golden), 4),
        "sub_em": substring_match(p, golden), "judge_correct": bool(v.correct), "judge_source": v.source,
        "judge_failed": v.judge_failed, "turns": t.num_turns, "searches": t.num_searches,
        "stop_reason": t.stop_reason, "queries": t.info.get("queries", []), "response": t.response_text,
    }


def _group_metrics(recs: list[dict], samples: int = 1) -> dict:
    """Means over questions; with samples K > 1 each per-sample field is a list of K, and the means run
    over all n*K samples, plus pass@K, mean@K and pass@k_unbiased from the judge verdicts."""
    n = len(recs)
    flat = recs if samples == 1 else [{key: r[key][j] for key in SAMPLE_FIELDS} for r in recs for j in range(samples)]
    m = len(flat)

    def mean(key: str) -> float:
        return round(sum(float(r[key]) for r in flat) / m, 4) if m else 0.0

    out = {
        "n": n, "em": mean("em"), "f1": mean("f1"), "sub_em": mean("sub_em"), "judge_acc": mean("judge_correct"),
        "turns_mean": mean("turns"), "searches_mean": mean("searches"),
        "no_answer_rate": round(sum(r["pred"] is None for r in flat) / m, 4) if m else 0.0,
        "judge_failed": sum(bool(r["judge_failed"]) for r in flat),
    }
    if samples > 1:
        correct = [sum(map(bool, r["judge_correct"])) for r in recs]
        out[f"pass@{samples}"] = round(sum(c > 0 for c in correct) / n, 4) if n else 0.0
        out[f"mean@{samples}"] = out["judge_acc"]
        out["pass@k_unbiased"] = {str(k): round(sum(pass_at_k(samples, c, k) for c in correct) / n, 4) if n else 0.0
                                  for k in pass_ks(samples)}
    return out


def evaluate(engine: Any, rows: Sequence[EvalRow], search_fn: Callable | None, cfg: EvalConfig) -> dict:
    """Roll out the solver cfg.samples times per row; returns {"overall", "per_source", "examples", "samples"}.

    overall / per_source[src]: n, em, f1, sub_em, judge_acc, turns_mean, searches_mean,
    no_answer_rate, judge_failed (+ pass@K, mean@K, pass@k_unbiased when K > 1). examples:
    one dict per row, in order; with K > 1 its SAMPLE_FIELDS are lists of K, in sample order.
    """
    K = cfg.samples
    examples: list[dict] = []
    per_chunk = max(1, cfg.batch_size // K)
    chunks = [rows[i: i + per_chunk] for i in range(0, len(rows), per_chunk)]
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(rows), desc="eval" if K == 1 else f"eval ({K} samples/q)", unit="q")
    for chunk in chunks:
        prompt = build_self_search_prompt if cfg.rollout.self_search else build_solver_prompt
        # K copies of each question, side by side: run_rollouts seeds trajectory i with (seed, i, turn),
        # so every sample of a question draws with its own seed, and each runs its own search loop.
        reqs = [RolloutRequest("solver", f"eval-{r.id}", prompt(engine.tokenizer, r.question, cfg.template),
                               question=r.question, answer=r.golden_answers) for r in chunk for _ in range(K)]
        trajs = run_rollouts(engine, reqs, search_fn, cfg.rollout)
        preds = [extract_answer(t.response_text) for t in trajs]
        verdicts = cfg.judge.judge_many([JudgeItem(q.question, q.answer, p) for q, p in zip(reqs, preds)])
        recs = [_sample_record(q.answer, t, p, v) for q, t, p, v in zip(reqs, trajs, preds, verdicts)]
        for i, r in enumerate(chunk):
            mine = recs[i * K: (i + 1) * K]
            fields = mine[0] if K == 1 else {key: [s[key] for s in mine] for key in SAMPLE_FIELDS}
            examples.append({"id": r.id, "data_source": r.data_source, "question": r.question,
                             "golden_answers": r.golden_answers, **fields})
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    by_src: dict[str, list[dict]] = defaultdict(list)
    for e in examples:
        by_src[e["data_source"]].append(e)
    return {
        "overall": _group_metrics(examples, K),
        "per_source": {src: _group_metrics(recs, K) for src, recs in sorted(by_src.items())},
        "examples": examples,
        "samples": K,
    }


# ---- reports ---------------------------------------------------------------------------------

def protocol_lines(protocol: dict) -> list[str]:
    return [f"- {k}: {v}" for k, v in protocol.items()]


def markdown_report(protocol: dict, result: dict) -> str:
    K = result.get("samples", 1)
    extra_head, note = "", []
    if K > 1:
        ks = "/".join(result["overall"]["pass@k_unbiased"])
        extra_head = f" pass@{K} | mean@{K} | pass@k unbiased (k={ks}) |"
        note = [f"{K} samples per question; pass@{K} = any sample correct (judge column), mean@{K} = accuracy "
                "over all samples; EM .. no answer are means over all samples.", ""]
    head = f"| data_source | n |{extra_head} EM | F1 | sub-EM | judge acc | turns | searches | no answer |"
    rows = ["|---|---|" + "---|" * (3 * (K > 1)) + "---|---|---|---|---|---|---|"]
    for name, m in list(result["per_source"].items()) + [("**overall**", result["overall"])]:
        extra = "" if K == 1 else (f" {m[f'pass@{K}']:.3f} | {m[f'mean@{K}']:.3f} | "
                                   + "/".join(f"{v:.3f}" for v in m["pass@k_unbiased"].values()) + " |")
        rows.append(f"| {name} | {m['n']} |{extra} {m['em']:.3f} | {m['f1']:.3f} | {m['sub_em']:.3f} | {m['judge_acc']:.3f} "
                    f"| {m['turns_mean']:.2f} | {m['searches_mean']:.2f} | {m['no_answer_rate']:.3f} |")
    return "\n".join(["# Evaluation", "", "## Protocol", "", *protocol_lines(protocol), "", "## Results", "", *note,
                      head, *rows, ""])


def write_outputs(out_dir: Path, protocol: dict, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"protocol": protocol, "overall": result["overall"], "per_source": result["per_source"]}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "results.md").write_text(markdown_report(protocol, result))
    with open(out_dir / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in result["examples"]:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")


# ---- command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # model and engine
    p.add_argument("--model", required=True, help="HF model folder (or a checkpoint's HF export) to evaluate")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="vllm (fast) or hf (the slow transformers reference)")
    p.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16, float16 (bf16 greedy differs from fp32)")
    p.add_argument("--max_model_len", type=int, default=4096, help="vLLM context length; >= --max_total_tokens")
    p.add_argument("--kv_cache_mb", type=int, default=0, help="CPU: vLLM KV cache in MiB (0 = room for 4 sequences of "
                   "--max_model_len); more lets vLLM batch more questions at once")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size (GPUs)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (matters only with --temperature > 0)")
    # data
    p.add_argument("--data", nargs="+", required=True, help="eval files: JSONL or parquet rows with question, golden_answers, data_source")
    p.add_argument("--limit", type=int, default=None, help="use only the first N rows of each file (a quick slice)")
    p.add_argument("--out_dir", required=True, help="folder for results.json, results.md, examples.jsonl and config.json")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier eval in --out_dir "
                   "(without it such a folder is refused)")
    # search backend (at most one)
    p.add_argument("--index", default=None, help="in-process retriever: an index folder built by retrieval/build_index.py")
    p.add_argument("--retriever_url", default=None, help="retrieval server URL (Search-R1 /retrieve API), e.g. http://127.0.0.1:8000")
    p.add_argument("--self_search", action="store_true", help="SSRL self-search: the model writes its own <information>; no tool")
    p.add_argument("--simulated", action="store_true", help="ZeroSearch simulated search: an LLM writes the documents")
    p.add_argument("--sim_url", default=None, help="simulator server (OpenAI-compatible); default: the evaluated model in-process")
    p.add_argument("--sim_model", default=None, help="simulator model name on --sim_url")
    p.add_argument("--sim_noise", type=float, default=0.0, help="chance of a noisy simulated document (0 = all useful)")
    # rollout protocol
    p.add_argument("--topk", type=int, default=3, help="documents per search")
    p.add_argument("--max_turns", type=int, default=4, help="generation turns per question (each search costs one)")
    p.add_argument("--max_tokens_per_turn", type=int, default=512, help="token cap of one turn")
    p.add_argument("--max_total_tokens", type=int, default=4096, help="cap on prompt + all turns + documents")
    p.add_argument("--max_info_tokens", type=int, default=512, help="token cap of one <information> block")
    p.add_argument("--template", default="auto", choices=list(TEMPLATES), help="prompt chat template (inference/prompts.py)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--samples", type=int, default=1, help="rollouts per question (needs --temperature > 0 when > 1); "
                   "K > 1 reports pass@K and mean@K: RL mostly turns pass@k into pass@1, so the gap between pass@K "
                   "and greedy EM is the headroom RL can harvest")
    p.add_argument("--batch_size", type=int, default=64, help="rollouts per batch (questions x --samples)")
    # judge
    p.add_argument("--judge_url", default=None, help="OpenAI-compatible judge server; without it the judge is exact match")
    p.add_argument("--judge_model", default=None, help="served judge model name (default: the server's first model)")
    p.add_argument("--judge_cache", default=None, help="SQLite file caching verdicts across runs")
    a = p.parse_args(argv)
    chosen = [f for f, on in (("--index", a.index), ("--retriever_url", a.retriever_url), ("--self_search", a.self_search),
                               ("--simulated", a.simulated)) if on]
    if len(chosen) > 1:
        p.error(f"choose one search backend, got {' and '.join(chosen)}")
    if (a.sim_url or a.sim_model) and not a.simulated:
        p.error("--sim_url/--sim_model configure --simulated, which is not set")
    if a.index and not (Path(a.index) / "manifest.json").exists():
        p.error(f"--index {a.index} is not a built index (no manifest.json); build one with "
                "`python -m retrieval.build_index --corpus FILE --out DIR --kind bm25`")
    taken = [n for n in OUTPUTS if (Path(a.out_dir) / n).exists()]
    if Path(a.out_dir).exists() and not Path(a.out_dir).is_dir():
        p.error(f"--out_dir {a.out_dir} is a file, not a folder")
    if taken and not a.overwrite:
        p.error(f"--out_dir {a.out_dir} already holds {', '.join(taken)} (an earlier eval, or another tool's "
                f"config.json); pass --overwrite to replace them, or pick another --out_dir")
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    if a.samples < 1:
        p.error(f"--samples must be >= 1, got {a.samples}")
    if a.samples > 1 and a.temperature <= 0:
        p.error(f"--samples {a.samples} needs --temperature > 0: greedy decoding (--temperature {a.temperature:g}) "
                "gives the same answer every time, so pass@K would equal greedy EM")
    if a.max_total_tokens > a.max_model_len and a.engine == "vllm":
        p.error(f"--max_total_tokens {a.max_total_tokens} exceeds --max_model_len {a.max_model_len}; raise the latter")
    return a


def build_search(a: argparse.Namespace, engine: Any = None) -> tuple[Callable | None, str]:
    """The search backend's `search` and how the protocol names it."""
    if a.self_search:
        return None, "self-search (SSRL): the model writes its own <information>, masked; no tool"
    if a.simulated:
        from retrieval.simulated import SimulatedSearch

        sim = SimulatedSearch(url=a.sim_url, engine=None if a.sim_url else engine, model=a.sim_model,
                              noise_start=a.sim_noise, noise_end=a.sim_noise, seed=a.seed, template=a.template,
                              show_answer=False)  # never leak the golden answer to the model under test
        return sim.search, f"simulated search (ZeroSearch): {sim.describe()}"
    if a.index:
        from retrieval.retriever import load_retriever

        r = load_retriever(a.index)
        desc = r.describe()
        return r.search, f"{desc.get('kind', r.kind)} index at {a.index} ({desc.get('count', len(r))} docs)"
    if a.retriever_url:
        from retrieval.client import RetrievalClient

        return RetrievalClient(a.retriever_url, topk=a.topk).search, f"retrieval server at {a.retriever_url}"
    return None, "none (no search tool)"


def build_engine(a: argparse.Namespace) -> Any:
    from inference.engines import HFEngine, VLLMEngine

    if a.engine == "hf":
        return HFEngine(a.model, dtype=a.dtype)
    return VLLMEngine(a.model, dtype=a.dtype, seed=a.seed, tensor_parallel_size=a.tp, max_model_len=a.max_model_len,
                      kv_cache_memory_bytes=(a.kv_cache_mb << 20) or None)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows: list[EvalRow] = []
    for path in a.data:
        rows += load_eval_rows(path, limit=a.limit)
    # The engine comes before the retriever: bm25s imports numba/llvmlite, and vLLM's CPU start-up
    # scan of every module's globals trips over llvmlite's `lib` object (AttributeError).
    engine = build_engine(a)
    search_fn, retriever_desc = build_search(a, engine)
    judge = Judge(a.judge_url, model=a.judge_model, cache_path=a.judge_cache) if a.judge_url else Judge()
    rollout = RolloutConfig(max_turns=a.max_turns, max_total_tokens=a.max_total_tokens,
                            max_tokens_per_turn=a.max_tokens_per_turn, max_info_tokens=a.max_info_tokens,
                            topk=a.topk, temperature=a.temperature, seed=a.seed if a.temperature > 0 else None,
                            self_search=a.self_search)
    protocol = {
        "model": str(Path(a.model).resolve()),
        "engine": f"{a.engine} ({a.dtype})",
        "retriever": retriever_desc,
        "topk": a.topk,
        "max_turns": a.max_turns,
        "token_caps": f"{a.max_tokens_per_turn}/turn, {a.max_info_tokens}/information block, {a.max_total_tokens} total",
        "template": a.template,
        "judge": judge.describe(),
        "sampling": ("greedy (temperature 0)" if a.temperature == 0 else f"temperature {a.temperature}, seed {a.seed}"
                     + (f", {a.samples} samples per question" if a.samples > 1 else "")),
        "examples": f"{len(rows)} from {', '.join(a.data)}" + (f" (first {a.limit} of each)" if a.limit else ""),
    }
    print("Evaluation protocol:\n" + "\n".join(protocol_lines(protocol)), flush=True)

    t0 = time.time()
    result = evaluate(engine, rows, search_fn, EvalConfig(rollout=rollout, template=a.template, judge=judge,
                                                          batch_size=a.batch_size, progress=True, samples=a.samples))
    protocol["eval_seconds"] = round(time.time() - t0, 1)
    out_dir = Path(a.out_dir)
    write_outputs(out_dir, protocol, result)
    (out_dir / "config.json").write_text(json.dumps(vars(a), indent=2) + "\n")
    print(markdown_report(protocol, result))
    print(f"wrote {out_dir}/results.json, results.md, examples.jsonl", flush=True)
    judge.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
