"""One rank of a vLLM tensor-parallel-2 group under torchrun (tests/inference/test_tp2.py).

argv: model_dir bm25_dir out_prefix rollout_config_json. Both ranks build VLLMEngine(tensor_parallel_size=2,
external_launcher=True) over gloo, generate greedily from the same prompts, then run the rollout
under both schedules with a BM25 search whose latency differs per rank, through a wrapper that records every
engine call. Each rank writes out_prefix.<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from inference.engine_api import SamplingConfig  # noqa: E402
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts  # noqa: E402

FEW_SHOT = (
    "Question: What is the capital of Italy?\n<search> capital of Italy </search>\n\n<information>Doc 1 (Title: Rome) "
    "Rome is the capital city of Italy.\n</information>\n\n<answer> Rome </answer>\n\n"
    "Question: Who discovered penicillin?\n<search> penicillin discovery </search>\n\n<information>Doc 1 (Title: "
    "Penicillin) Penicillin was discovered by Alexander Fleming in 1928.\n</information>\n\n<answer> Alexander Fleming "
    "</answer>\n\n"
)
PROMPTS = [FEW_SHOT + f"Question: {q}\n" for q in
           ("What is the capital of France?", "Who wrote Hamlet?", "Which river flows through Vienna?",
             "Who painted the Mona Lisa?")]


class RecordingEngine:
    """Passes every call through to the engine and logs (method, prompts, sampling)."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self.lockstep_ranks, self.lockstep_first = engine.lockstep_ranks, engine.lockstep_first
        self.calls: list = []
        self.shares = 0

    def generate(self, prompts, sampling):
        sp = sampling if isinstance(sampling, list) else [sampling]
        self.calls.append(["generate", [list(map(int, p)) for p in prompts], [repr(s) for s in sp]])
        return self.engine.generate(prompts, sampling)

    def submit(self, key, prompt, sampling):
        self.calls.append(["submit", repr(key), list(map(int, prompt)), repr(sampling)])
        return self.engine.submit(key, prompt, sampling)

    def step(self):
        out = self.engine.step()
        self.calls.append(["step", [repr(k) for k, _ in out]])
        return out

    def share_from_first(self, obj):
        self.shares += 1
        return self.engine.share_from_first(obj)

    def num_unfinished(self):
        return self.engine.num_unfinished()

    def abort_all(self):
        self.engine.abort_all()


def main() -> None:
    import torch.distributed as dist

    model_dir, bm25_dir, out_prefix, rollout_cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from inference.engines import VLLMEngine
    from retrieval.retriever import load_retriever

    t0 = time.perf_counter()
    eng = VLLMEngine(model_dir, dtype="float32", seed=0, tensor_parallel_size=2, external_launcher=True,
                     max_model_len=1024)
    t_start = time.perf_counter() - t0
    tok = eng.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    outs = eng.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=16, min_tokens=16))
    result = {"rank": rank, "tp": eng.lockstep_ranks, "startup_s": t_start,
              "prompts": prompts, "greedy": [o.token_ids for o in outs], "greedy_logprobs": [o.logprobs for o in outs]}

    retr = load_retriever(bm25_dir)
    searches = []

    def search(queries, topk):
        # Rank 0's every other search is slow, rank 1's are all fast: were both to search, their results would
        # come back at different moments, and each rank alone would resume its trajectories in another order.
        time.sleep(0.3 if rank == 0 and len(searches) % 2 else 0.0)
        searches.append(list(queries))
        return retr.search(queries, topk)

    reqs = [RolloutRequest("solver", f"g{i}", p, question=PROMPTS[i]) for i, p in enumerate(prompts)]
    for schedule in ("trajectory", "turn"):
        rec, stats, searches[:] = RecordingEngine(eng), {}, []
        trajs = run_rollouts(rec, reqs, search, RolloutConfig(schedule=schedule, **rollout_cfg), stats=stats)
        result[schedule] = dict(schedule=stats["schedule"], calls=rec.calls, searches=list(searches), shares=rec.shares,
                                trajectories=[{"ids": t.token_ids, "mask": t.loss_mask, "stop": t.stop_reason,
                                               "turns": t.num_turns, "searches": t.num_searches} for t in trajs])
        eng.reset_prefix_cache()
    Path(f"{out_prefix}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    del eng
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
