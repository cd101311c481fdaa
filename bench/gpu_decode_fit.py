"""Time one batched decode step of a causal LM (plain transformers + torch) over batch size x context, and fit it.

    python bench/gpu_decode_fit.py --out decode_fit.json                     # on a GPU: Qwen2.5-7B shape, bf16
    python bench/gpu_decode_fit.py --out decode_fit.json --shape qwen2.5-1.5b
    .venv/bin/python bench/gpu_decode_fit.py --out /tmp/tiny.json --tiny    # here: 2-layer tiny Qwen2, fp32, CPU

Random weights (no download, no network). Each grid point: prefill B random prompts of length L into a DynamicCache
(in chunks of sequences, logits_to_keep=1 so no B*L*vocab logits), then `--steps` timed decode steps of one token per
sequence after `--warmup` untimed ones, synchronized around each. Fits step_s = a + b*B + c*(B*L) and
prefill_s = p0 + p1*tokens by least squares. These are HF steps (dense, re-concatenated KV cache, SDPA, no CUDA graphs,
eager launches): an upper bound on a vLLM step for the same batch, not vLLM (issue 44's emulated GPU decode).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {  # config.json values of the released models
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                       tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=False),
}
GRID = dict(gpu=((1, 8, 32, 64, 128, 256), (256, 1024, 2048)), tiny=((1, 4), (32, 64)))
NOTE = ("transformers (HF) decode steps: dense DynamicCache re-concatenated every step, SDPA attention, "
        "no CUDA graphs, eager kernel launches, greedy argmax on the last logits. An upper bound on a vLLM engine "
        "step's time for the same batch (paged KV, CUDA graphs, fused kernels); these are not vLLM steps.")


def build(shape: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(**SHAPES[shape], use_cache=True)
    with torch.device(device):  # parameters are created (and randomly initialised) on the device itself
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval(), cfg


def _kv(cache, i):
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # older transformers


def prefill(model, cfg, ids: torch.Tensor, chunk_tokens: int):
    """Prompts ids (B, L), prefilled `chunk_tokens // L` sequences at a time, merged into one cache."""
    from transformers import DynamicCache
    B, L = ids.shape
    per = max(1, chunk_tokens // L)
    chunks = []
    for s in range(0, B, per):
        c = DynamicCache()
        model(input_ids=ids[s:s + per], past_key_values=c, use_cache=True, logits_to_keep=1)
        chunks.append(c)
    if len(chunks) == 1:
        return chunks[0]
    merged = DynamicCache()
    for i in range(cfg.num_hidden_layers):  # layer by layer, freeing the chunks' copies as it goes
        kv = [_kv(c, i) for c in chunks]
        merged.update(torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), i)
        del kv
        for c in chunks:
            if hasattr(c, "layers"):
                c.layers[i].keys = c.layers[i].values = None
            else:
                c.key_cache[i] = c.value_cache[i] = None
    return merged


def point(model, cfg, B, L, args, device, sync) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (B, L), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pres = []
    for _ in range(args.prefill_repeats):  # the last one's cache is decoded
        cache = None
        sync()
        t0 = time.perf_counter()
        cache = prefill(model, cfg, ids, args.prefill_chunk_tokens)
        sync()
        pres.append(time.perf_counter() - t0)
    pre = min(pres)  # fastest of the repeats: on a shared CPU load only ever adds time
    tok = torch.randint(0, cfg.vocab_size, (B, 1), device=device)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    del cache, out
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return dict(B=B, L=L, tokens=B * L, prefill_s=pre, prefill_tok_s=B * L / pre, step_s=statistics.median(times),
                step_min_s=min(times), step_max_s=max(times), steps=len(times), prefill_all_s=pres, peak_gib=peak)


def fit(X: np.ndarray, y: np.ndarray, names: list[str]) -> dict:
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {**dict(zip(names, map(float, coef))), "max_rel_err": float(np.max(np.abs(pred - y) / y)), "r2": r2,
            "pred": [float(p) for p in pred]}


def summarize(args, shape, device, dtype, points, skipped, build_s, start) -> dict:
    """The fits and the JSON, written after every grid point too, so a run killed midway still leaves its points."""
    fits = {}
    if len(points) >= 3:
        B, L = (np.array([p[k] for p in points], dtype=float) for k in ("B", "L"))
        y = np.array([p["step_s"] for p in points])
        fits["step_s"] = fit(np.stack([np.ones_like(B), B, B * L], 1), y, ["a", "b", "c"])
        fits["step_s"]["model"] = "step_s = a + b*B + c*(B*L)   [B sequences, L prompt tokens each (+<=warmup+steps)]"
        pf = np.array([p["prefill_s"] for p in points])
        fits["prefill_s"] = fit(np.stack([np.ones_like(B), B * L], 1), pf, ["p0", "p1"])
        fits["prefill_s"]["model"] = "prefill_s = p0 + p1*tokens   [tokens = B*L]"
    import transformers
    env = dict(torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype).split(".")[-1],
               device=torch.cuda.get_device_name() if device == "cuda" else "cpu", shape=shape, arch=SHAPES[shape],
               attn="sdpa", steps=args.steps, warmup=args.warmup, prefill_chunk_tokens=args.prefill_chunk_tokens,
               prefill_repeats=args.prefill_repeats)
    res = dict(env=env, points=points, skipped=skipped, fits=fits, build_s=build_s,
               total_s=time.perf_counter() - start, note=NOTE)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="2-layer tiny Qwen2, fp32, CPU: the test's run")
    ap.add_argument("--shape", default="qwen2.5-7b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--batches", default="", help="comma list overriding the grid's batch sizes")
    ap.add_argument("--lengths", default="", help="comma list overriding the grid's context lengths")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefill_chunk_tokens", type=int, default=32768)
    ap.add_argument("--prefill_repeats", type=int, default=0, help="fastest of this many prefills (0: 5 tiny, 1 GPU)")
    ap.add_argument("--max_seconds", type=float, default=240.0, help="grid points not started by then are skipped")
    args = ap.parse_args(argv)
    args.prefill_repeats = args.prefill_repeats or (5 if args.tiny else 1)
    start = time.perf_counter()
    shape = "tiny" if args.tiny else args.shape
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the full shape needs a GPU (--tiny runs on CPU)")
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    Bs, Ls = GRID["tiny" if args.tiny else "gpu"]
    Bs = [int(x) for x in args.batches.split(",")] if args.batches else Bs
    Ls = [int(x) for x in args.lengths.split(",")] if args.lengths else Ls
    if args.tiny:  # one intra-op thread: on a shared CPU, threads waiting on each other turn load into 10x spikes
        torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.inference_mode():
        model, cfg = build(shape, device, dtype)
        build_s = time.perf_counter() - start
        point(model, cfg, 1, 16, argparse.Namespace(**{**vars(args), "steps": 1}), device, sync)  # kernels, cuBLAS
        points, skipped = [], []
        for L in Ls:
            for B in Bs:
                if time.perf_counter() - start > args.max_seconds:
                    skipped.append(dict(B=B, L=L, reason=f"past --max_seconds {args.max_seconds}"))
                    continue
                try:
                    points.append(point(model, cfg, B, L, args, device, sync))
                except torch.OutOfMemoryError as e:
                    skipped.append(dict(B=B, L=L, reason=f"OOM: {str(e).splitlines()[0][:200]}"))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                summarize(args, shape, device, dtype, points, skipped, build_s, start)
    res = summarize(args, shape, device, dtype, points, skipped, build_s, start)
    env, fits = res["env"], res["fits"]
    print(f"{shape} {env['dtype']} on {env['device']}: torch {env['torch']}, transformers {env['transformers']}")
    print(f"{'B':>5} {'L':>6} {'step ms':>9} {'fit ms':>8} {'prefill s':>10} {'prefill tok/s':>14}")
    for i, p in enumerate(points):
        fp = fits["step_s"]["pred"][i] * 1e3 if fits else float("nan")
        print(f"{p['B']:>5} {p['L']:>6} {p['step_s'] * 1e3:>9.2f} {fp:>8.2f} {p['prefill_s']:>10.3f} "
              f"{p['prefill_tok_s']:>14.0f}")
    for s in skipped:
        print(f"{s['B']:>5} {s['L']:>6} skipped: {s['reason']}")
    for k, v in fits.items():
        consts = ", ".join(f"{n}={v[n]:.4g}" for n in ("a", "b", "c", "p0", "p1") if n in v)
        print(f"{k}: {consts}; max rel err {v['max_rel_err']:.1%}, R^2 {v['r2']:.4f}")
    print(f"total {res['total_s']:.1f} s (build {build_s:.1f} s) -> {args.out}")
    return res


if __name__ == "__main__":
    main()
