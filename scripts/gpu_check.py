"""What to run on one lent GPU in under 20 minutes; on a CPU the same steps at tiny scale (CI runs that).

    bash scripts/gpu_check.sh [OUT.json]                      # the wrapper: wheels, environment, then this
    python scripts/gpu_check.py --out gpu_check.json [--tiny] [--skip_pytest]

Steps, each recorded in the JSON with its numbers, a status, and a log tail when it failed:
  env       torch / CUDA / GPU / transformers / DeepSpeed / Triton versions.
  pytest    every GPU-marked test (`pytest -m gpu`; on a CPU they are all skipped, which is recorded).
  model     the policy folder. SmolLM2-135M-Instruct when its weights are here; otherwise (a lent GPU
            takes 64 MiB of files, the weights are 517 MB) the same architecture and tokenizer with
            random weights, said so in the JSON. --tiny: a 2-layer random Llama (the CPU check).
  train     train.py under torchrun, world size 1 (NCCL on a GPU, gloo on a CPU), --rollout_engine hf
            (a lent GPU has no vLLM), ZeRO-3, bf16 on a GPU, BM25 search, 3 SSP steps, an HF export
            at the end. On a GPU the packed log-probs run the compiled Triton kernel and one SDPA call
            per packed sequence on CUDA. Per step: rollout/actor log-prob gap, seconds, tokens.
  logprobs  the exported model's packed log-probs on this device (the path training takes: Triton on
            a GPU, the chunked torch head on a CPU) against an independent reference: plain fp32
            torch on the CPU, one unpacked sequence at a time, full-vocabulary log_softmax.
  export    the HF export against DeepSpeed's own fp32 reconstruction of the ZeRO-3 checkpoint
            (get_fp32_state_dict_from_zero_checkpoint): every tensor, max abs difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from utils.dist import free_port  # noqa: E402


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


def step_env() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "transformers": transformers.__version__,
           "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(0), cuda_runtime=torch.version.cuda,
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    from importlib.metadata import PackageNotFoundError, version

    # Versions from the metadata, not by importing: bm25s's import alone took 60 GiB of an H100 (JAX).
    for dist in ("deepspeed", "triton", "vllm", "flash-attn", "bm25s", "jax"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out


def step_pytest(env: dict, work: Path) -> dict:
    # Only the files that hold GPU tests are collected: the others import what a lent GPU lacks (faiss, FastAPI).
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in f.read_text())
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
                        "--junitxml", str(work / "gpu_tests.xml"), *files], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    summary = (r.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    # exit 5 = nothing selected: no GPU test collected is a failure of this check, not a pass
    ok = r.returncode == 0 and counts.get("passed", 0) + counts.get("skipped", 0) > 0
    res = {"status": "ok" if ok else "failed", "returncode": r.returncode, "summary": summary, "counts": counts,
           "failures": re.findall(r"^(?:FAILED|ERROR) .*$", r.stdout, re.M)}
    if not ok:
        res["log_tail"] = _tail(r.stdout + r.stderr)
    return res


def step_model(args, work: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = Path(args.model)
    out = work / "model"
    if out.exists():
        shutil.rmtree(out)
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    if args.tiny:
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          tie_word_embeddings=True, use_cache=False)
        LlamaForCausalLM(cfg).save_pretrained(out)
        kind = "tiny random Llama (2 layers, hidden 128) with SmolLM2's tokenizer"
    elif any(src.glob("*.safetensors")):
        shutil.copytree(src, out)
        kind = f"{src.name}, real weights"
    else:
        cfg = AutoConfig.from_pretrained(src)
        cfg.use_cache = False
        LlamaForCausalLM(cfg).save_pretrained(out)
        kind = f"{src.name} architecture and tokenizer, RANDOM weights (the real ones are not on this machine)"
    tok.save_pretrained(out)
    for f in ("generation_config.json", "chat_template.jinja"):
        if (src / f).exists() and not (out / f).exists():
            shutil.copy(src / f, out / f)
    n = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(out).parameters())
    return {"status": "ok", "model": kind, "params": n, "path": str(out)}


def step_train(args, env: dict, work: Path, model_dir: str, cuda: bool) -> dict:
    data = Path(args.data_dir)
    corpus = work / "corpus.jsonl"
    with (data / "corpus/wiki.jsonl").open() as f, corpus.open("w") as g:
        for i, line in zip(range(args.corpus_docs), f):
            g.write(line)
    shutil.rmtree(work / "bm25", ignore_errors=True)  # a re-run rebuilds it (build_index refuses to overwrite)
    r = subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(corpus), "--out",
                        str(work / "bm25"), "--kind", "bm25"], cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        return {"status": "failed", "stage": "index", "log_tail": _tail(r.stdout + r.stderr)}
    rows, qa = work / "rows.jsonl", work / "qa.jsonl"
    with (data / "train/proposer.jsonl").open() as f:
        rows.write_text("".join(line for _, line in zip(range(64), f)))
    with (data / "train/solver_qa.jsonl").open() as f:
        qa.write_text("".join(line for _, line in zip(range(64), f)))
    out = work / "run"
    if out.exists():
        shutil.rmtree(out)
    big = not args.tiny
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "train.py", "--model_path", model_dir, "--rollout_engine", "hf", "--dtype", "bf16" if cuda else "fp32",
           "--gradient_checkpointing", "true" if big else "false", "--train_data", str(rows), "--index",
           str(work / "bm25"), "--prompts_per_step", "4" if big else "1",
           "--solver_n", "4" if big else "2", "--total_steps", str(args.steps), "--max_turns", "3", "--min_searches", "1",
           "--max_tokens_per_turn", "96" if big else "16", "--max_total_tokens", "1536" if big else "512",
           "--max_model_len", "2048" if big else "1024", "--micro_token_budget", "4096" if big else "1024",
           # half the solver's questions from fixed QA: a random-weight policy writes no valid question, and
           # the solver would not play; entropy and a KL reference give every step a gradient
           "--qa_data", str(qa), "--qa_mix_fraction", "0.5", "--entropy_coef", "0.01", "--kl_coef", "0.001",
           "--lr", "1e-5", "--save_every", str(args.steps), "--export_hf", "true", "--tensorboard", "false",
           "--sample_every", "0", "--output_dir", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.train_timeout)
    wall = time.perf_counter() - t0
    (work / "train.log").write_text(r.stdout + r.stderr)
    res: dict = {"returncode": r.returncode, "wall_s": round(wall, 1), "command": " ".join(cmd[5:])}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()] if (out / "metrics.jsonl").exists() else []
    keep = ("actor/rollout_lp_gap", "actor/num_tokens", "actor/pg_loss", "actor/grad_norm", "sync/seconds",
            "timing_s/generate", "timing_s/logprobs", "timing_s/update", "timing_s/step", "rollout/solver_trajs",
            "rollout/proposer_trajs", "actor/skipped_steps")
    res["steps"] = [{k: m[k] for k in ("step", *keep) if k in m} for m in metrics]
    res["hybrid_line"] = next((ln for ln in (r.stdout + r.stderr).splitlines() if "hybrid engine:" in ln), "")
    hf = out / f"checkpoints/step_{args.steps:06d}/hf"
    ok = r.returncode == 0 and len(metrics) == args.steps and hf.is_dir()
    gaps = [m.get("actor/rollout_lp_gap") for m in metrics]
    # bf16 rollout (HF engine) against a bf16 ZeRO-3 forward: rounding, not a stale sync, sets the gap
    res["max_rollout_lp_gap"] = max((g for g in gaps if g is not None), default=None)
    res["status"] = "ok" if ok else "failed"
    res["hf_export"] = str(hf)
    res["checkpoint"] = str(out / f"checkpoints/step_{args.steps:06d}")
    if not ok:
        res["log_tail"] = _tail(r.stdout + r.stderr, 6000)
    return res


def step_logprobs(hf_dir: str, cuda: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.packing import pack_micro_batches

    dev = "cuda" if cuda else "cpu"
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    V = ref_model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(40, 400, (6,), generator=g)]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lens]
    masks = [torch.cat([torch.zeros(8), torch.ones(n - 8)]) for n in lens]
    with torch.no_grad():
        ref = []
        for s in seqs:  # the independent reference: unpacked, fp32, CPU, full-vocabulary log_softmax
            lp = torch.log_softmax(ref_model(input_ids=s[None], use_cache=False).logits[0].float(), -1)
            ref.append(torch.cat([torch.zeros(1), lp[:-1].gather(1, s[1:, None])[:, 0]]))
    out = {"sequences": len(seqs), "tokens": sum(lens), "device": dev}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
        (mb,) = pack_micro_batches(seqs, sum(lens), per_token={"loss_mask": masks})
        with torch.no_grad():
            lp, ent = sequence_logprobs(model, mb.to(dev), compute_entropy=True)
        got = [x.float().cpu() for x in mb.unpack(lp)]
        diffs = [(a - b)[m.bool()].abs().max().item() for a, b, m in zip(got, ref, masks)]
        out[f"{name}_max_abs_diff"] = max(diffs)
        out[f"{name}_entropy_finite"] = bool(torch.isfinite(ent).all())
        if cuda:
            from training.algorithm.logprobs import use_triton_kernel
            out["triton_kernel"] = bool(use_triton_kernel(torch.empty(1, device=dev)))
        del model
    # fp32 on any device: the same numbers up to summation order; bf16: rounding of a 135M model
    out["status"] = "ok" if out["fp32_max_abs_diff"] < 2e-3 and out["fp32_entropy_finite"] else "failed"
    return out


def step_export(hf_dir: str, ckpt_dir: str) -> dict:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    exported: dict = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        exported.update(load_file(str(f)))
    ckpt = Path(ckpt_dir)
    ds = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    ds = {k.removeprefix("module."): v for k, v in ds.items()}
    missing = sorted(set(ds) - set(exported) - {"lm_head.weight"})  # a tied lm_head is written once
    diffs = {k: (exported[k].float() - ds[k].float()).abs().max().item() for k in exported if k in ds}
    dtypes = sorted({str(t.dtype) for t in exported.values()})
    worst = max(diffs.values(), default=float("inf"))
    # a bf16 export of fp32 master weights differs by bf16 rounding (relative 2^-8); fp32 must be exact
    tol = 0.0 if dtypes == ["torch.float32"] else max(float(v.abs().max()) for v in ds.values()) * 2**-8
    return {"status": "ok" if not missing and worst <= tol else "failed", "tensors": len(exported),
            "missing": missing[:5], "dtypes": dtypes, "max_abs_diff": worst, "tolerance": tol}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="where the JSON report goes")
    p.add_argument("--work", default="runs/gpu_check", help="scratch folder: model, index, run, logs")
    p.add_argument("--data_dir", default=os.environ.get("SSP_DATA_DIR", str(REPO / "data")),
                   help="prepared data (scripts/prepare_data.py): corpus, proposer rows, the SmolLM2 folder")
    p.add_argument("--model", default="", help="policy folder; default <data_dir>/models/SmolLM2-135M-Instruct")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random model and short rollouts (the CPU check)")
    p.add_argument("--skip_pytest", action="store_true", help="leave out `pytest -m gpu`")
    p.add_argument("--steps", type=int, default=3, help="SSP steps of the training run")
    p.add_argument("--corpus_docs", type=int, default=2000, help="documents of the BM25 index")
    p.add_argument("--train_timeout", type=int, default=900, help="seconds before the training run is stopped")
    args = p.parse_args()
    args.model = args.model or str(Path(args.data_dir) / "models/SmolLM2-135M-Instruct")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", SSP_DATA_DIR=args.data_dir)
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": {}}

    def run(name, fn, *a):
        t0 = time.perf_counter()
        try:
            res = fn(*a)
        except Exception:  # noqa: BLE001 - one broken step must not hide the others' results
            res = {"status": "failed", "error": _tail(traceback.format_exc())}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = res
        Path(args.out).write_text(json.dumps(report, indent=1))  # written after every step: a kill keeps the rest
        print(f"gpu_check: {name}: {res['status']} ({res['seconds']} s)", flush=True)
        return res

    env_info = run("env", lambda: {"status": "ok", **step_env()})
    cuda = bool(env_info.get("cuda"))
    if not cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("TRITON_INTERPRET", "1")
    if not args.skip_pytest:
        run("pytest", step_pytest, env, work)
    model = run("model", step_model, args, work)
    if model["status"] == "ok":
        train = run("train", step_train, args, env, work, model["path"], cuda)
        if train["status"] == "ok":
            run("logprobs", step_logprobs, train["hf_export"], cuda)
            run("export", step_export, train["hf_export"], train["checkpoint"])
    report["ok"] = all(s["status"] == "ok" for s in report["steps"].values())
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"gpu_check: {'all steps ok' if report['ok'] else 'SOME STEPS FAILED'}; report in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
