"""TRL's GRPOTrainer on the solver's task, single-turn: the peer side of bench/bench_peer_trl.py.

    PYTHONPATH=.trl_overlay .venv/bin/python bench/peer_trl_run.py --model M --out runs/peer_trl/trl_hf --steps 5
    (bench/bench_peer_trl.py launches it with the overlay on PYTHONPATH and the settings it gives train.py)

The prompt is ours (inference.prompts.solver_user_message, as a user message through the model's chat template,
as render_chat does), the rows are --qa_data's, and the reward is ours (inference.rewards: the last <answer>, exact
match after normalisation, divided by 4 when the answer tag is spammed). Single-turn: a <search> gets no
<information> back (TRL's tool calls are JSON in a chat template's tool-call format, not our <search> protocol).
Per optimizer step it appends one JSON line to OUT/steps.jsonl: the step's seconds, the rollout's (generation,
scoring, advantages: `_generate_and_score_completions`), the sampled tokens and the mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from inference.prompts import solver_user_message  # noqa: E402
from inference.rewards import extract_answer, is_answer_spam, solver_reward  # noqa: E402
from utils.text import exact_match  # noqa: E402


def reward_fn(completions, golden_answers, **_):
    out = []
    for c in completions:
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(solver_reward(bool(exact_match(extract_answer(text), golden_answers)), is_answer_spam(text)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder of the start model")
    p.add_argument("--qa_data", default="data/train/solver_qa.jsonl", help="QA rows (question, golden_answers)")
    p.add_argument("--out", required=True, help="output folder (steps.jsonl)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--prompts_per_step", type=int, default=2, help="questions per step")
    p.add_argument("--group", type=int, default=4, help="completions per question (num_generations)")
    p.add_argument("--max_tokens", type=int, default=128, help="max_completion_length")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate (constant)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="HF generate, or vLLM colocated")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed")
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in open(a.qa_data) if line.strip()][: a.steps * a.prompts_per_step * 4]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": solver_user_message(r["question"])}],
                             "golden_answers": r["golden_answers"]} for r in rows])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vllm = {} if a.engine == "hf" else {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 2048,
        "vllm_gpu_memory_utilization": 0.05, "vllm_enable_sleep_mode": False}
    args = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, report_to=[], seed=a.seed, max_steps=a.steps,
        per_device_train_batch_size=a.prompts_per_step * a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=a.max_tokens, temperature=a.temperature, top_p=1.0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, scale_rewards="group", num_iterations=1,
        bf16=False, fp16=False, model_init_kwargs={"dtype": "float32"}, logging_steps=1, save_strategy="no",
        gradient_checkpointing=False, dataloader_num_workers=0, **vllm)
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward_fn, args=args, train_dataset=ds)

    state = {"rollout": 0.0, "tokens": 0, "rewards": [], "t0": None}
    gen = trainer._generate_and_score_completions

    def timed_generate(inputs):
        t = time.perf_counter()
        res = gen(inputs)
        state["rollout"] += time.perf_counter() - t
        mask = res["completion_mask"] * res.get("tool_mask", 1)
        state["tokens"] += int(mask.sum())
        return res

    trainer._generate_and_score_completions = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, args_, st, control, **kw):
            state["t0"], state["rollout"], state["tokens"] = time.perf_counter(), 0.0, 0

        def on_log(self, args_, st, control, logs=None, **kw):
            if logs and "reward" in logs:
                state["rewards"].append(float(logs["reward"]))

        def on_step_end(self, args_, st, control, **kw):
            dt = time.perf_counter() - state["t0"]
            row = {"step": st.global_step, "step_s": dt, "rollout_s": state["rollout"],
                   "update_s": dt - state["rollout"], "sampled_tokens": state["tokens"]}
            with (out / "steps.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")

    trainer.add_callback(Steps())
    (out / "steps.jsonl").unlink(missing_ok=True)
    trainer.train()
    rows = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    for r, rew in zip(rows, state["rewards"]):
        r["reward_mean"] = rew
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
