"""Benchmarks of the training maths (training/), side by side in one run; writes section "loss".

    .venv/bin/python bench/bench_loss.py                 # all parts, about 5-10 min on 2 shared cores
    .venv/bin/python bench/bench_loss.py --repeats 1 --seqs 8 --mem-tokens 1024   # a quick look

(a) A packed train step (forward + backward, one row per micro-batch, the varlen sdpa
    of training/algorithm/packing.py) against a right-padded one (fixed sequences per micro-batch,
    padded to the longest), on lognormal multi-turn lengths in [200, 4000], with a
    ~5M-parameter Qwen2; a third row packs with plain sdpa and a 4D block mask. Both use the same chunked log-prob head and the same loss, so the ratio
    measures packing alone. Reported in useful (non-pad) tokens/s; the losses and
    gradients of the two must agree.
(b) Peak memory of log-prob + entropy, forward + backward, at V = 151,936: the chunked
    function against full fp32 logits + log_softmax. Each variant runs in a fresh
    subprocess; the figure is the rise of the peak RSS (VmHWM, reset through
    /proc/self/clear_refs just before the call) over the RSS at that moment, so the
    inputs and a tiny warm-up are not counted.
(c) TRL's `selective_log_softmax_and_entropy` on full logits against ours, the same way
    (at --trl-tokens), if TRL is importable. It is not installed in .venv:
    `pip install --dry-run trl` is run and reported; to run (c), put TRL on PYTHONPATH,
    e.g. `pip install --no-deps --target DIR trl` and `PYTHONPATH=DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The code this section measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/bench_loss.py", "training/algorithm/logprobs.py", "training/algorithm/loss.py", "training/algorithm/packing.py"]

import torch  # noqa: E402

from bench.report import md_table, write_results  # noqa: E402

# ----------------------------------------------------------------------------- args
p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
# (a) packed vs padded
p.add_argument("--seqs", type=int, default=12, help="sequences per train step")
p.add_argument("--median-len", type=float, default=700.0, help="median of the lognormal sequence length")
p.add_argument("--sigma", type=float, default=0.8, help="sigma of the lognormal sequence length")
p.add_argument("--min-len", type=int, default=200, help="lengths are clipped to at least this")
p.add_argument("--max-len", type=int, default=4000, help="lengths are clipped to at most this")
p.add_argument("--max-tokens", type=int, default=4096, help="token budget of a packed micro-batch")
p.add_argument("--padded-mb", type=int, default=4, help="sequences per padded micro-batch")
p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the small model in (a)")
p.add_argument("--no-mask-variant", dest="mask_variant", action="store_false",
               help="skip the third row of (a): packed with plain sdpa and a 4D block-diagonal mask")
p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (medians are reported)")
p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
p.add_argument("--seed", type=int, default=0, help="seed for lengths, tokens and weights")
# (b) / (c) memory
p.add_argument("--mem-tokens", type=int, default=4096, help="T for the memory benchmark")
p.add_argument("--mem-vocab", type=int, default=151_936, help="V for the memory benchmark (Qwen2's vocabulary)")
p.add_argument("--mem-hidden", type=int, default=256, help="H for the memory benchmark")
p.add_argument("--mem-chunk", type=int, default=0, help="chunk size of the chunked variant (0 = auto)")
p.add_argument("--trl-tokens", type=int, default=1024,
               help="T for (c); smaller than --mem-tokens because TRL's path, like the full one, needs ~5 T*V*4 "
                    "bytes and the machine is shared (our chunked path is re-measured at the same T)")
p.add_argument("--skip-trl", action="store_true", help="skip the TRL dry run and comparison (c)")
p.add_argument("--only-a", action="store_true", help="run (a) only and print it (implies --no-write)")
p.add_argument("--no-write", action="store_true", help="print only; do not write bench/results.json / RESULTS.md")
p.add_argument("--child", choices=["full", "chunked", "trl"], help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- (a) packed vs padded

def _workload(args):
    g = torch.Generator().manual_seed(args.seed)
    mu = math.log(args.median_len)
    lengths = [int(min(args.max_len, max(args.min_len, round(math.exp(mu + args.sigma * float(torch.randn(1, generator=g)))))))
               for _ in range(args.seqs)]
    ids, masks, advs = [], [], []
    for n in lengths:
        ids.append(torch.randint(0, args.vocab, (n,), generator=g))
        # Multi-turn shape: a prompt, then sampled spans (1) alternating with retrieved text (0).
        m = torch.zeros(n, dtype=torch.long)
        i, sampled = min(120, n // 4), True
        while i < n:
            span = int(torch.randint(20, 200, (1,), generator=g))
            m[i:i + span] = int(sampled)
            i, sampled = i + span, not sampled
        masks.append(m)
        advs.append(torch.full((n,), float(torch.randn(1, generator=g))))
    return lengths, ids, masks, advs


def _model(vocab):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


def _packed_step(model, mbs, norm, varlen=True):
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.loss import policy_loss
    total = 0.0
    for mb in mbs:
        lp, _ = sequence_logprobs(model, mb, 1.0, varlen_sdpa=varlen)
        loss, _ = policy_loss(lp, mb.tensors["old_logprobs"], mb.tensors["advantages"], mb.tensors["loss_mask"],
                              normaliser=norm)
        loss.backward()
        total += float(loss.detach())
    return total


def _padded_batches(ids, masks, advs, olds, per_mb):
    out = []
    for s in range(0, len(ids), per_mb):
        sl = slice(s, s + per_mb)
        width = max(len(x) for x in ids[sl])

        def pad(xs, v=0):
            return torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=v) for x in xs])
        attn = pad([torch.ones_like(x) for x in ids[sl]])
        out.append((pad(ids[sl]), attn, pad(masks[sl]), pad(advs[sl]), pad(olds[sl])))
    return out


def _padded_step(model, batches, norm):
    """The usual padded path: (B, L) rows with a 2D attention mask; same head and loss as packed."""
    from training.algorithm.logprobs import chunked_logprobs_entropy
    from training.algorithm.loss import policy_loss
    head = model.get_output_embeddings()
    total = 0.0
    for ids, attn, mask, adv, old in batches:
        hidden = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state   # (B, L, H)
        b_idx, t_idx = torch.nonzero(mask, as_tuple=True)                 # sampled tokens (never position 0)
        lp_sel, _ = chunked_logprobs_entropy(hidden[b_idx, t_idx - 1], head.weight, ids[b_idx, t_idx],
                                             compute_entropy=False)
        lp = torch.zeros(ids.shape).index_put((b_idx, t_idx), lp_sel)
        loss, _ = policy_loss(lp, old, adv, mask, normaliser=norm)
        loss.backward()
        total += float(loss.detach())
    return total


def bench_packing(args):
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.packing import pack_micro_batches, unpack_to_sequences

    import copy
    lengths, ids, masks, advs = _workload(args)
    model = _model(args.vocab)
    # A copy that keeps plain sdpa, fed the 4D block-diagonal mask (sequence_logprobs would switch `model`).
    mask_model = copy.deepcopy(model) if args.mask_variant else None
    n_params = sum(p.numel() for p in model.parameters())
    mbs = pack_micro_batches(ids, args.max_tokens, per_token={"loss_mask": masks, "advantages": advs})
    with torch.no_grad():   # old log-probs = the current policy's (first PPO epoch: ratio 1)
        olds = unpack_to_sequences(mbs, [sequence_logprobs(model, mb, 1.0)[0] for mb in mbs], len(ids))
    mbs = pack_micro_batches(ids, args.max_tokens,
                             per_token={"loss_mask": masks, "advantages": advs, "old_logprobs": olds})
    padded = _padded_batches(ids, masks, advs, olds, args.padded_mb)
    norm = int(sum(int(m.sum()) for m in masks))
    useful = sum(lengths)
    padded_tokens = sum(b[0].numel() for b in padded)

    names = ["packed", "padded"] + (["packed_mask"] if mask_model is not None else [])
    times = {k: [] for k in names}
    losses, grads = {}, {}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            m = mask_model if name == "packed_mask" else model
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if name == "padded":
                losses[name] = _padded_step(m, padded, norm)
            else:
                losses[name] = _packed_step(m, mbs, norm, varlen=name == "packed")
            times[name].append(time.perf_counter() - t0)
            grads[name] = [p.grad.clone() for p in m.parameters()]
            print(f"(a) repeat {r} {name}: {times[name][-1]:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads["packed"], grads["padded"]))
    return {
        "n_params": n_params, "lengths": lengths, "useful": useful, "padded_tokens": padded_tokens,
        "n_packed_mbs": len(mbs), "n_padded_mbs": len(padded), "times": times, "median": med,
        "tps_packed": useful / med["packed"], "tps_padded": useful / med["padded"],
        "speedup": med["padded"] / med["packed"], "loss_packed": losses["packed"], "loss_padded": losses["padded"],
        "losses": losses,
        "loss_diff": abs(losses["packed"] - losses["padded"]), "grad_diff": grad_diff,
    }


# ----------------------------------------------------------------------------- (b)/(c) memory, in a child

def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def _reset_peak() -> float:
    """Reset the peak-RSS mark to the current RSS and return it (MB).

    ru_maxrss alone is not enough: after fork+exec a child starts with its parent's
    high-water mark, which hides anything smaller. Writing 5 to /proc/self/clear_refs
    resets VmHWM (Linux >= 4.0); where that is refused, fall back to ru_maxrss.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mb("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _peak_mb() -> float:
    try:
        return _status_mb("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def child(args):
    """Run one variant (fwd + bwd) and print its peak-RSS rise and time as JSON."""
    from training.algorithm.logprobs import chunked_logprobs_entropy, full_logprobs_entropy
    t_len, v, h = args.mem_tokens, args.mem_vocab, args.mem_hidden
    if args.child == "trl":
        from trl.trainer.utils import selective_log_softmax_and_entropy

        def run(hid, w, tgt):
            logits = hid @ w.t()                                            # what the HF lm_head returns
            return selective_log_softmax_and_entropy(logits, tgt)
    elif args.child == "full":
        def run(hid, w, tgt):
            return full_logprobs_entropy(hid, w, tgt)
    else:
        def run(hid, w, tgt):
            return chunked_logprobs_entropy(hid, w, tgt, chunk_size=args.mem_chunk or None, backend="torch")

    def inputs(n):
        g = torch.Generator().manual_seed(0)
        hid = torch.randn(n, h, generator=g).requires_grad_(True)
        w = (torch.randn(v, h, generator=g) * 0.05).requires_grad_(True)
        return hid, w, torch.randint(0, v, (n,), generator=g)

    small = inputs(8)                               # warm-up: lazy library state is not counted
    lp, ent = run(*small)
    (lp.sum() + ent.sum()).backward()
    hid, w, tgt = inputs(t_len)
    base = _reset_peak()
    t0 = time.perf_counter()
    lp, ent = run(hid, w, tgt)
    (lp.sum() + ent.sum()).backward()
    elapsed = time.perf_counter() - t0
    out = {"variant": args.child, "peak_rise_mb": _peak_mb() - base, "seconds": elapsed}
    if args.child == "trl":   # the numbers agree with ours
        ours = chunked_logprobs_entropy(hid[:256].detach(), w.detach(), tgt[:256], backend="torch")
        out["max_abs_diff_vs_ours"] = max(float((lp[:256].detach() - ours[0]).abs().max()),
                                          float((ent[:256].detach() - ours[1]).abs().max()))
    if args.child == "trl":
        import trl
        out["version"] = trl.__version__
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args, variant, tokens: int | None = None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", variant, "--mem-tokens", str(tokens or args.mem_tokens),
           "--mem-vocab", str(args.mem_vocab), "--mem-hidden", str(args.mem_hidden), "--mem-chunk",
           str(args.mem_chunk), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"(b) variant {variant} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    res = json.loads(lines[-1][len("RESULT "):])
    print(f"(b/c) {variant} T={tokens or args.mem_tokens}: peak rise {res['peak_rise_mb']:.0f} MB, "
          f"{res['seconds']:.1f} s", flush=True)
    return res


def _mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def trl_dry_run() -> dict:
    """What `pip install --dry-run trl` would change in .venv, against our pins."""
    # Without PYTHONPATH: a TRL put there for (c) would read as "already satisfied".
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "trl"], capture_output=True,
                          text=True, timeout=600, env=env)
    would = re.findall(r"^Would install (.*)$", proc.stdout, re.M)
    pkgs = would[-1].split() if would else []
    pins = {}
    for req in ("requirements-cpu.txt",):
        for line in (REPO / req).read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.\-]+)==", line.strip())
            if m:
                pins[m.group(1).lower().replace("_", "-")] = line.strip()
    changed = [x for x in pkgs if x.rsplit("-", 1)[0].lower().replace("_", "-") in pins]
    return {"ok": proc.returncode == 0 and bool(would), "would_install": pkgs, "changes_pinned": changed,
            "error": "" if proc.returncode == 0 else proc.stderr[-500:]}


# ----------------------------------------------------------------------------- main

def main():
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)

    a = bench_packing(args)
    if args.only_a:
        print(json.dumps({k: v for k, v in a.items() if k != "lengths"}, indent=1))
        return
    # (b): the full variant holds several fp32 (T, V) tensors; refuse to start it when RAM is short.
    need_mb = 5 * args.mem_tokens * args.mem_vocab * 4 / 2**20
    mem = {}
    for variant in ("chunked", "full"):
        if variant == "full" and _mem_available_mb() < need_mb * 1.25:
            print(f"(b) skipping full: needs ~{need_mb:.0f} MB, {_mem_available_mb():.0f} MB available",
                  file=sys.stderr)
            continue
        mem[variant] = run_child(args, variant)
    dry, trl_res, trl_ours, has_trl = None, None, None, False
    if not args.skip_trl:
        dry = trl_dry_run()
        try:
            import importlib.util
            has_trl = importlib.util.find_spec("trl") is not None
        except (ImportError, ValueError):
            has_trl = False
        need_trl = 5 * args.trl_tokens * args.mem_vocab * 4 / 2**20
        if has_trl and dry["ok"] and not dry["changes_pinned"] and _mem_available_mb() > need_trl * 1.3:
            trl_res = run_child(args, "trl", args.trl_tokens)
            trl_ours = run_child(args, "chunked", args.trl_tokens)

    keys = {
        "loss.packed_speedup": round(a["speedup"], 3),
        "loss.packed_tokens_per_s": round(a["tps_packed"], 1),
        "loss.padded_tokens_per_s": round(a["tps_padded"], 1),
        "loss.packed_loss_abs_diff": a["loss_diff"],
        "loss.packed_grad_max_abs_diff": a["grad_diff"],
        "loss.padding_fraction": round(1 - a["useful"] / a["padded_tokens"], 4),
    }
    rows_a = [
        ["packed, varlen sdpa (one causal call per sequence)", a["n_packed_mbs"], a["useful"],
         f"{a['median']['packed']:.2f}", f"{a['tps_packed']:.0f}", f"{a['loss_packed']:.9f}"],
        [f"padded ({args.padded_mb} seqs/micro-batch, 2D mask)", a["n_padded_mbs"], a["padded_tokens"],
         f"{a['median']['padded']:.2f}", f"{a['tps_padded']:.0f}", f"{a['loss_padded']:.9f}"],
    ]
    if "packed_mask" in a["median"]:
        rows_a.append(["packed, plain sdpa + 4D block-diagonal mask", a["n_packed_mbs"], a["useful"],
                       f"{a['median']['packed_mask']:.2f}", f"{a['useful'] / a['median']['packed_mask']:.0f}",
                       f"{a['losses']['packed_mask']:.9f}"])
        keys["loss.packed_mask_speedup"] = round(a["median"]["padded"] / a["median"]["packed_mask"], 3)
    md = [f"### (a) Packed vs padded train step (forward + backward)\n\n"
          f"Qwen2, {a['n_params'] / 1e6:.1f}M params (hidden 256, 4 layers, vocab {args.vocab}), fp32, "
          f"{args.threads} thread(s); {args.seqs} sequences, lognormal lengths (median {args.median_len:.0f}, "
          f"sigma {args.sigma}) clipped to [{args.min_len}, {args.max_len}]: min {min(a['lengths'])}, "
          f"max {max(a['lengths'])}, total {a['useful']} tokens. Packed budget {args.max_tokens} tokens. "
          f"Medians over {args.repeats} repeats, order alternating.\n",
          md_table(["variant", "micro-batches", "tokens computed", "step s (median)", "useful tokens/s", "loss"],
                   rows_a),
          f"\n**Speedup {a['speedup']:.2f}x** (target >= 2x). Loss difference {a['loss_diff']:.2e}, max gradient "
          f"difference {a['grad_diff']:.2e}. Padding fraction of the padded run "
          f"{1 - a['useful'] / a['padded_tokens']:.2f}. Step times (s): "
          + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in a["times"].items()) + ". "
          "The 4D-mask row shows why CPU packing uses the varlen sdpa: a block-diagonal mask still computes "
          "attention over the whole row (T^2), the per-sequence calls only sum(L_i^2)."]

    md.append(f"\n### (b) Peak memory of log-prob + entropy, forward + backward\n\n"
              f"T = {args.mem_tokens}, V = {args.mem_vocab}, H = {args.mem_hidden}, fp32, each variant in a fresh "
              f"process; rise of the peak RSS (VmHWM reset just before the call) over the RSS then (inputs already "
              f"allocated; every variant also allocates the (V, H) weight gradient).\n")
    rows_b = []
    for name, label in (("chunked", "chunked (training/algorithm/logprobs.py, torch path)"),
                        ("full", "full fp32 logits + log_softmax")):
        if mem.get(name):
            rows_b.append([label, f"{mem[name]['peak_rise_mb']:.0f}", f"{mem[name]['seconds']:.2f}"])
    md.append(md_table(["variant", "peak rise MB", "fwd+bwd s"], rows_b))
    if mem.get("chunked") and mem.get("full"):
        ratio = mem["chunked"]["peak_rise_mb"] / mem["full"]["peak_rise_mb"]
        keys.update({"loss.logprob_mem_ratio": round(ratio, 4),
                     "loss.logprob_peak_mb_chunked": round(mem["chunked"]["peak_rise_mb"], 1),
                     "loss.logprob_peak_mb_full": round(mem["full"]["peak_rise_mb"], 1),
                     "loss.logprob_time_ratio": round(mem["chunked"]["seconds"] / mem["full"]["seconds"], 3)})
        md.append(f"\n**Memory ratio chunked / full = {ratio:.3f}** (target <= 0.125), "
                  f"time ratio {mem['chunked']['seconds'] / mem['full']['seconds']:.2f}.")
    else:
        md.append("\nThe full variant did not run (see stderr: not enough free RAM or a failure); no ratio.")

    md.append("\n### (c) TRL\n")
    if args.skip_trl:
        md.append("Skipped (--skip-trl).")
    else:
        md.append(f"`pip install --dry-run trl` in .venv: would install {' '.join(dry['would_install']) or '(nothing)'}"
                  f"; pinned packages it would change: {', '.join(dry['changes_pinned']) or 'none'}"
                  f"{'; dry run failed: ' + dry['error'] if not dry['ok'] else ''}. TRL is not installed in .venv.")
        if trl_res and trl_ours:
            ratio_trl = trl_ours["peak_rise_mb"] / trl_res["peak_rise_mb"]
            keys.update({"loss.trl_peak_mb": round(trl_res["peak_rise_mb"], 1),
                         "loss.logprob_mem_ratio_vs_trl": round(ratio_trl, 4),
                         "loss.logprob_time_ratio_vs_trl": round(trl_ours["seconds"] / trl_res["seconds"], 3)})
            md.append(f"\nTRL {trl_res.get('version', '')} put on PYTHONPATH (not in .venv): its "
                      f"`selective_log_softmax_and_entropy` on the (T, V) fp32 logits the lm_head returns (its CPU "
                      f"path; TRL's Triton kernel needs CUDA) against ours, forward + backward, measured as in (b) at "
                      f"T = {args.trl_tokens}, V = {args.mem_vocab}, H = {args.mem_hidden}:\n")
            md.append(md_table(["variant", "peak rise MB", "fwd+bwd s"], [
                ["ours (chunked)", f"{trl_ours['peak_rise_mb']:.0f}", f"{trl_ours['seconds']:.2f}"],
                ["TRL", f"{trl_res['peak_rise_mb']:.0f}", f"{trl_res['seconds']:.2f}"]]))
            md.append(f"\nOurs / TRL: memory {ratio_trl:.3f}, time {trl_ours['seconds'] / trl_res['seconds']:.2f}; "
                      f"log-probs and entropies agree to {trl_res['max_abs_diff_vs_ours']:.1e}.")
        elif dry["changes_pinned"]:
            md.append("\nSkipped: installing TRL would change pinned packages.")
        elif not has_trl:
            md.append("\nTRL is not importable here, so the comparison was not run.")
        else:
            md.append("\nNot run: the dry run failed or there was not enough free RAM (see stderr).")
    text = "\n".join(md)
    print(text)
    print(json.dumps(keys, indent=1))
    if not args.no_write:
        write_results("loss", keys, text, measures=MEASURES)


if __name__ == "__main__":
    main()
