"""Our packed GRPO-family loss against TRL's GRPOTrainer loss, on one fixed batch: the loss and every gradient.

    PYTHONPATH=.trl_overlay .venv/bin/python bench/peer_trl_loss.py          # prints a JSON line per loss type
    (bench/bench_peer_trl.py runs it in a child process with the overlay on PYTHONPATH; bench/peer_trl_env.py
    installs the overlay)

One fixed batch, fp32: a tiny random Llama (2 layers, hidden 128, head_dim 64, vocab 512) from a config, B
sequences of G per prompt with prompts and completions of different lengths, completion masks with holes (a
truncated / tool-masked tail), old log-probs = the current ones plus noise (so the ratio leaves 1 and both clip
sides act), one advantage per sequence, sampling temperature 0.8. Two copies of the same weights:
- TRL: `GRPOTrainer._compute_loss` of a real trainer (built on the tiny model, `use_cpu`, one process, gradient
  accumulation 1), fed the padded batch as its `_prepare_inputs` would (left-padded prompts, right-padded
  completions, old_per_token_logps, advantages, num_items_in_batch); its own fused lm-head log-probs.
- Ours: the same sequences packed without padding into several one-row micro-batches (a token budget that splits
  the batch), `training.algorithm.logprobs.sequence_logprobs` (per-sequence SDPA, chunked lm-head) and
  `training.algorithm.loss.policy_loss` with the global normaliser of `count_normaliser`, one backward per micro-batch
  accumulated, as training/algorithm/update.py does.

The loss types matched (TRL name -> our --loss_agg and normaliser):
  bnpo     token-mean           (sum over the batch's completion tokens / their count: our default)
  dapo     token-mean           (TRL divides by num_items_in_batch, the generation batch's tokens: the same here)
  grpo     seq-mean-token-mean  (mean over each sequence's tokens, then over sequences)
  dr_grpo  seq-mean-token-sum with normaliser N_seqs x max_completion_length. train.py's seq-mean-token-sum
           divides by N_seqs only (training/algorithm/update.py passes count_normaliser): the same direction, a loss
           max_completion_length times TRL's. That constant has no train.py flag, so this row calls policy_loss
           with the paper's normaliser directly, and the report says so.
Not matched: TRL's cispo/sapo/vespo/luspo (we have none); our seq-mean-token-sum's N_seqs normaliser (no TRL type).
With `--kl` both add a k3 KL to a reference (TRL beta = our kl_coef) on the grpo row, with TRL's
`use_bias_correction_kl=False`. TRL's default (True, DeepSeek-V3.2's) multiplies each token's KL by the ratio, which
ours never does: that row is printed too, marked unmatched, and its difference is a real one (about 2e-3 here).

Relative differences: the loss's |ours - TRL| / |TRL|; the gradients' max over parameter tensors of
max|g_ours - g_TRL| / max|g_TRL| (an element-wise ratio is undefined where a gradient is ~0). The target is 1e-5.
Why that holds on every CPU kernel (AVX2, AVX-512, AMX): fp32's unit roundoff is 6e-8; the two sides differ in the
order of sums (padded batch with a 4D mask and shifted RoPE positions against per-sequence SDPA; a fused lm-head
against our chunked one; accumulated micro-batches against one batch) over reductions of at most a few hundred
terms (hidden 128, 256 and a few hundred tokens), whose rounding error grows like sqrt(n) x 6e-8 ~ 1e-6 at the
worst, and through 2 layers' backward. 1e-5 leaves a 10x margin over that, and it is 100x below the smallest
real difference of normalisation (dividing by one more token in 300: 3e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOSS_TYPES = {  # TRL loss_type -> (our agg, normaliser kind)
    "bnpo": ("token-mean", "count"),
    "dapo": ("token-mean", "count"),
    "grpo": ("seq-mean-token-mean", "count"),
    "dr_grpo": ("seq-mean-token-sum", "seqs_x_max_len"),
}
TARGET = 1e-5
VOCAB, PAD = 512, 0


def tiny_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=PAD, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def tiny_tokenizer(folder: Path):
    """A word-level tokenizer over VOCAB ids (GRPOTrainer needs a processing class; the loss never decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return fast


def fixed_batch(n_prompts: int = 3, group: int = 4, max_completion: int = 24, seed: int = 1):
    """Token ids, masks, advantages and the noise of the old log-probs: (prompts, completions, masks, adv, noise)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts, comps, masks, adv = [], [], [], []
    for p in range(n_prompts):
        plen = int(torch.randint(5, 14, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (plen,), generator=g).tolist()
        rewards = torch.rand(group, generator=g)
        a = (rewards - rewards.mean()) / (rewards.std() + 1e-4)        # group-normalised, as GRPO's
        for k in range(group):
            clen = int(torch.randint(6, max_completion + 1, (1,), generator=g))
            comp = torch.randint(3, VOCAB, (clen,), generator=g).tolist()
            m = [1] * clen
            if k % 3 == 1:                                              # a masked span (tool output / truncation)
                s = clen // 3
                m[s:s + 3] = [0] * len(m[s:s + 3])
            prompts.append(prompt)
            comps.append(comp)
            masks.append(m)
            adv.append(float(a[k]))
    noise = [torch.randn(len(c), generator=g) * 0.3 for c in comps]
    return prompts, comps, masks, adv, noise


def current_logprobs(model, prompts, comps, temperature):
    """Reference per-token log-probs of each completion (plain full-logit forward, one sequence at a time)."""
    import torch

    out = []
    with torch.no_grad():
        for p, c in zip(prompts, comps):
            ids = torch.tensor([p + c])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1))
    return out


def make_trainer(model, loss_type: str, *, temperature: float, max_completion: int, beta: float, folder: Path,
                 bias_correction_kl: bool = False):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = tiny_tokenizer(folder / "tok")
    if beta:   # TRL loads its reference model from the policy's path: give it one (the same weights)
        model.save_pretrained(folder / "ref")
        model.config._name_or_path = str(folder / "ref")
    args = GRPOConfig(output_dir=str(folder / "out"), use_cpu=True, report_to=[], loss_type=loss_type,
                      num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=max_completion, temperature=temperature, beta=beta,
                      epsilon=0.2, epsilon_high=0.28, scale_rewards="group", logging_steps=1, save_strategy="no",
                      bf16=False, fp16=False, use_bias_correction_kl=bias_correction_kl)
    ds = Dataset.from_dict({"prompt": ["w3 w4 w5"] * 8})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=ds, processing_class=tok)
    if not hasattr(trainer, "current_gradient_accumulation_steps"):   # set by Trainer's loop; one window here
        trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.set_grad_enabled(True)
    return trainer


def trl_inputs(prompts, comps, masks, adv, old, ref):
    """The padded dict GRPOTrainer._prepare_inputs hands _compute_loss (prompts left-, completions right-padded)."""
    import torch

    b, lp, lc = len(prompts), max(map(len, prompts)), max(map(len, comps))
    pid, pm = torch.full((b, lp), PAD), torch.zeros(b, lp, dtype=torch.long)
    cid, cm, tm = torch.full((b, lc), PAD), torch.zeros(b, lc, dtype=torch.long), torch.zeros(b, lc, dtype=torch.long)
    oldp, refp = torch.zeros(b, lc), torch.zeros(b, lc)
    for i, (p, c, m) in enumerate(zip(prompts, comps, masks)):
        pid[i, lp - len(p):], pm[i, lp - len(p):] = torch.tensor(p), 1
        cid[i, :len(c)], cm[i, :len(c)], tm[i, :len(c)] = torch.tensor(c), 1, torch.tensor(m)
        oldp[i, :len(c)], refp[i, :len(c)] = old[i], ref[i]
    # completion_mask: the completion's real tokens (all attended); tool_mask: 0 on tokens the model did not
    # sample (TRL's multi-turn tool results), which carry no loss: our loss_mask is completion_mask x tool_mask
    out = {"prompt_ids": pid, "prompt_mask": pm, "completion_ids": cid, "completion_mask": cm, "tool_mask": tm,
           "advantages": torch.tensor(adv), "old_per_token_logps": oldp, "ref_per_token_logps": refp,
           "num_items_in_batch": (cm * tm).sum().float()}
    return out


def our_loss(model, prompts, comps, masks, adv, old, ref, *, agg, norm_kind, max_completion, temperature,
             kl_coef, budget):
    """Sum of the micro-batch losses (each its share of the global loss), backward run on each."""
    import torch
    from training.algorithm.logprobs import sequence_logprobs
    from training.algorithm.loss import count_normaliser, policy_loss
    from training.algorithm.packing import pack_micro_batches

    ids, per = [], {"loss_mask": [], "old_logprobs": [], "advantages": [], "ref_logprobs": []}
    for p, c, m, a, o, r in zip(prompts, comps, masks, adv, old, ref):
        z = [0.0] * len(p)
        ids.append(p + c)
        per["loss_mask"].append(torch.tensor([0] * len(p) + m))
        per["old_logprobs"].append(torch.tensor(z + list(map(float, o))))
        per["advantages"].append(torch.tensor(z + [a] * len(c)))
        per["ref_logprobs"].append(torch.tensor(z + list(map(float, r))))
    mbs = pack_micro_batches(ids, budget, per_token=per)
    if norm_kind == "count":
        normaliser = sum(count_normaliser(mb.tensors["loss_mask"], agg, mb.cu_seqlens) for mb in mbs)
    else:   # Dr. GRPO's constant: sequences x max completion length (training/algorithm/loss.py's docstring)
        normaliser = len(ids) * max_completion
    total = 0.0
    for mb in mbs:
        lp, _ = sequence_logprobs(model, mb, temperature)
        t = mb.tensors
        loss, _ = policy_loss(lp, t["old_logprobs"], t["advantages"], t["loss_mask"], normaliser=normaliser,
                              agg=agg, cu_seqlens=mb.cu_seqlens, clip_low=0.2, clip_high=0.28,
                              ref_logprobs=t["ref_logprobs"] if kl_coef else None, kl_coef=kl_coef,
                              kl_estimator="k3")
        loss.backward()
        total += float(loss.detach())
    return total, len(mbs)


def rel_diffs(loss_ours, loss_trl, model_ours, model_trl) -> dict:
    grads_o = dict(model_ours.named_parameters())
    worst, where = 0.0, ""
    for name, p in model_trl.named_parameters():
        g_t, g_o = p.grad, grads_o[name].grad
        scale = float(g_t.abs().max())
        if scale == 0.0:
            continue
        r = float((g_o - g_t).abs().max()) / scale
        if r > worst:
            worst, where = r, name
    return {"loss_ours": loss_ours, "loss_trl": loss_trl, "loss_rel_diff": abs(loss_ours - loss_trl) / abs(loss_trl),
            "grad_rel_diff": worst, "grad_worst_param": where}


def compare(loss_type: str, *, kl: bool = False, bias_correction_kl: bool = False, temperature: float = 0.8, max_completion: int = 24,
            budget: int = 96, seed: int = 0) -> dict:
    """One loss type on the fixed batch: both losses, both gradients, their relative differences."""
    import copy

    import torch

    torch.manual_seed(seed)
    agg, norm_kind = LOSS_TYPES[loss_type]
    beta = 0.04 if kl else 0.0
    prompts, comps, masks, adv, noise = fixed_batch(max_completion=max_completion)
    base = tiny_model(seed)
    cur = current_logprobs(base, prompts, comps, temperature)
    old = [c + n for c, n in zip(cur, noise)]
    ref = [c - n.flip(0) * 0.5 for c, n in zip(cur, noise)]   # a reference model's log-probs, near the policy's

    model_trl, model_ours = copy.deepcopy(base), copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(model_trl, loss_type, temperature=temperature, max_completion=max_completion,
                               beta=beta, folder=Path(tmp), bias_correction_kl=bias_correction_kl)
        loss = trainer._compute_loss(trainer.model, trl_inputs(prompts, comps, masks, adv, old, ref))
        loss.backward()
        loss_trl = float(loss.detach())
    model_ours.train()
    loss_ours, n_mbs = our_loss(model_ours, prompts, comps, masks, adv, old, ref, agg=agg, norm_kind=norm_kind,
                                max_completion=max_completion, temperature=temperature, kl_coef=beta, budget=budget)
    out = rel_diffs(loss_ours, loss_trl, model_ours, trainer.model)
    name = loss_type + ("+kl" if kl else "") + ("(ratio-weighted)" if kl and bias_correction_kl else "")
    out.update({"loss_type": name, "matched": not (kl and bias_correction_kl), "our_agg": agg,
                "our_normaliser": "N_seqs x max_completion_length" if norm_kind != "count" else "count_normaliser",
                "sequences": len(comps), "completion_tokens": int(sum(sum(m) for m in masks)),
                "micro_batches": n_mbs, "temperature": temperature})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss-types", default=",".join(LOSS_TYPES), help="TRL loss types to compare")
    p.add_argument("--kl", action="store_true", help="also the grpo row with a k3 KL term (beta 0.04)")
    a = p.parse_args()
    import torch
    import transformers
    import trl
    torch.set_num_threads(1)
    print(json.dumps({"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                   "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}}))
    for lt in a.loss_types.split(","):
        print(json.dumps(compare(lt)), flush=True)
    if a.kl:
        print(json.dumps(compare("grpo", kl=True)), flush=True)
        # TRL's default (use_bias_correction_kl=True) weights the KL by the ratio; ours does not: not a match
        print(json.dumps(compare("grpo", kl=True, bias_correction_kl=True)), flush=True)


if __name__ == "__main__":
    main()
