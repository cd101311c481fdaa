"""Measure the train-phase terms of training/engine/memory_plan.py on one CUDA GPU (world size 1).

    python bench/memory_plan_gpu.py --out measured.json      # on a GPU machine (needs deepspeed)
    .venv/bin/python bench/memory_plan_gpu.py --report measured.json   # here: writes the RESULTS.md section

A randomly initialised Qwen2.5-0.5B/1.5B-shaped model (no download) under the repo's own ZeRO-3
config (training/engine_builder.build_ds_config), torch AdamW, the repo's packed log-prob path
(training/logprobs.sequence_logprobs, the Triton head on CUDA). torch.cuda.max_memory_allocated
counts tensors only, so the plan's assumed 2 GiB runtime (CUDA context, NCCL) is left out of the
comparison. The generate phase (vLLM) is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import md_table, write_results  # noqa: E402
from training.engine import memory_plan as mp  # noqa: E402
from training.settings.config import Config  # noqa: E402
from utils.dist import free_port  # noqa: E402

SHAPES = {  # the architectures of Qwen2.5-0.5B and -1.5B (their config.json values)
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
CASES = [("qwen2.5-1.5b", True, 16384), ("qwen2.5-0.5b", True, 16384), ("qwen2.5-0.5b", False, 4096)]


def measure(shape: str, ckpt: bool, tokens: int) -> dict:
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.engine.engine_builder import build_ds_config
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.packing import MicroBatch

    cfg = Config()
    cfg.model.gradient_checkpointing, cfg.optimisation.micro_token_budget = ckpt, tokens
    ds = build_ds_config(cfg, train=True)
    arch = SHAPES[shape]
    hf = Qwen2Config(**{k: v for k, v in arch.items() if k != "model_type"}, use_cache=False)
    hf._attn_implementation = "sdpa"
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = Qwen2ForCausalLM(hf).to(torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    seq = 2048
    n = tokens // seq
    dev = engine.device
    mb = MicroBatch(input_ids=torch.randint(0, arch["vocab_size"], (1, tokens), device=dev),
                    position_ids=torch.arange(seq, device=dev).repeat(n)[None],
                    cu_seqlens=torch.arange(0, tokens + 1, seq, device=dev, dtype=torch.int32), max_seqlen=seq,
                    seq_indices=list(range(n)), tensors={"loss_mask": torch.ones(tokens, device=dev)})

    def fwd_bwd():
        lp, _ = sequence_logprobs(engine.module, mb)
        engine.backward(-lp.mean())

    fwd_bwd()
    engine.step()                                     # creates Adam's states
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    fb = torch.cuda.max_memory_allocated() - before - states
    torch.cuda.reset_peak_memory_stats()
    engine.step()
    torch.cuda.synchronize()
    step = torch.cuda.max_memory_allocated() - before - states
    res = dict(shape=shape, gradient_checkpointing=ckpt, tokens=tokens, measured=dict(states=states, fwd_bwd=fb, step=step),
               measured_peak=states + max(fb, step), device=torch.cuda.get_device_name())
    res["planned"] = planned(shape, ckpt, tokens)
    del engine, model, opt
    return res


def planned(shape: str, ckpt: bool, tokens: int) -> dict:
    """The plan's figures for one measured case (recomputed at --report time, so they follow the plan)."""
    cfg = Config()
    cfg.model.gradient_checkpointing, cfg.optimisation.micro_token_budget = ckpt, tokens
    t = mp.plan(cfg, 1, 1, arch=SHAPES[shape], arch_source=shape, with_deepspeed=False)["train"]
    return dict(states=t["params"] + t["grads"] + t["optimizer"], fwd_bwd=t["working_set"],
                step=t["optimizer_step_transient"], peak_without_runtime=t["peak"] - t["runtime"])


def report(path: str) -> None:
    rows, keys = [], {}
    runs = json.loads(Path(path).read_text())
    for r in runs:
        m, p = r["measured"], planned(r["shape"], r["gradient_checkpointing"], r["tokens"])
        g = lambda x: round(x / (1 << 30), 2)  # noqa: E731
        rows.append([r["shape"], "on" if r["gradient_checkpointing"] else "off", r["tokens"],
                     g(m["states"]), g(p["states"]), g(m["fwd_bwd"]), g(p["fwd_bwd"]), g(m["step"]), g(p["step"]),
                     g(r["measured_peak"]), g(p["peak_without_runtime"])])
        case = f"memory_plan.gpu.{r['shape']}.ckpt{int(r['gradient_checkpointing'])}"
        keys[f"{case}.peak_planned_over_measured"] = round(p["peak_without_runtime"] / r["measured_peak"], 3)
        keys[f"{case}.fwd_bwd_planned_over_measured"] = round(p["fwd_bwd"] / m["fwd_bwd"], 3)
    md = (f"Train-phase terms of `training/engine/memory_plan.py` against `torch.cuda.max_memory_allocated` on one "
          f"{runs[0]['device']} (world size 1, bf16, the repo's ZeRO-3 config, torch AdamW, the packed log-prob "
          f"path with the Triton head; random weights of the named shape; 2048-token sequences packed to the "
          f"budget; SDPA, no flash-attn installed). States are measured after the first optimizer step; the "
          f"forward+backward and step columns are the peaks above the states. Tensors only: the plan's 2 GiB "
          f"runtime term is left out. GiB. Measured in a run of `bench/memory_plan_gpu.py` (its JSON: "
          f"`bench/memory_plan_gpu.json`); the plan columns are recomputed from the current plan.\n\n"
          + md_table(["shape", "grad ckpt", "tokens", "states meas.", "states plan", "fwd+bwd meas.", "fwd+bwd plan",
                      "step meas.", "step plan", "peak meas.", "peak plan"], rows) + "\n")
    write_results("memory-plan-gpu", keys, md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="measure on this machine's GPU and write the JSON here")
    ap.add_argument("--report", default="", help="write the RESULTS.md section from a measured JSON")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl")
    runs = []
    for shape, ckpt, tokens in CASES:
        runs.append(measure(shape, ckpt, tokens))
        print(json.dumps(runs[-1]), flush=True)
        Path(args.out).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
