"""Cold-start SFT (training/loop/sft.py): the rollout mask rule, no gradient from masked tokens,
and a real ZeRO-3 run on a tiny model that lowers its loss and exports an HF folder."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

DOCS = [{"id": "1", "contents": "Carmen\nCarmen is an opera in four acts by the French composer Georges Bizet.",
         "score": 3.0},
        {"id": "2", "contents": "Georges Bizet\nGeorges Bizet was a French composer of the Romantic era.", "score": 2.0}]


def solver_demo(q="What is the name of the 1875 opera by Georges Bizet?", a="Carmen", trailing_info=None):
    turns = [{"kind": "model", "text": "<search> 1875 opera by Georges Bizet </search>"},
             {"kind": "info", "docs": DOCS},
             {"kind": "model", "text": f"<think> Doc 1 names it. </think>\n<answer> {a} </answer>"}]
    if trailing_info is not None:
        turns.append({"kind": "info", "docs": trailing_info})
    return {"role": "solver", "question": q, "answer": [a], "turns": turns}


def proposer_demo(a="Carmen"):
    return {"role": "proposer", "answer": a, "n_searches": 1,
            "turns": [{"kind": "model", "text": f"<search> {a} </search>"}, {"kind": "info", "docs": DOCS},
                      {"kind": "model", "text": "<question> What is the name of the 1875 opera by Georges Bizet? </question>"}]}


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_render_demo_follows_the_rollout_mask_rule(tok):
    from inference.prompts import build_proposer_prompt, build_solver_prompt, format_docs
    from inference.rollout import info_block_tokens
    from training.loop.sft import render_demo

    ids, mask = render_demo(tok, solver_demo(), "auto", max_info_tokens=384)
    prompt = build_solver_prompt(tok, "What is the name of the 1875 opera by Georges Bizet?")
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    t1 = tok("<search> 1875 opera by Georges Bizet </search>", add_special_tokens=False)["input_ids"]
    info = info_block_tokens(tok, format_docs(DOCS), 384)
    p = len(prompt)
    assert ids[p:p + len(t1)] == t1 and all(mask[p:p + len(t1)])
    assert ids[p + len(t1):p + len(t1) + len(info)] == info and not any(mask[p + len(t1):p + len(t1) + len(info)])
    tail = tok.decode([i for i, m in zip(ids, mask) if m])
    assert tail.endswith("</answer>") and "Carmen" in tail and "opera in four acts" not in tail
    # documents are cut to the same budget a rollout uses
    ids_small, mask_small = render_demo(tok, solver_demo(), "auto", max_info_tokens=24)
    assert len(ids) - len(ids_small) == len(info) - 24 and sum(mask_small) == sum(mask)
    pids, pmask = render_demo(tok, proposer_demo(), "auto")
    pprompt = build_proposer_prompt(tok, "Carmen", 1)
    assert pids[:len(pprompt)] == pprompt and tok.decode([i for i, m in zip(pids, pmask) if m]).endswith("</question>")


def test_render_demo_refuses_bad_rows(tok):
    from training.loop.sft import render_demo
    with pytest.raises(ValueError, match="role"):
        render_demo(tok, {"role": "judge", "turns": []})
    with pytest.raises(ValueError, match="no model turn"):
        render_demo(tok, {"role": "solver", "question": "q", "turns": [{"kind": "info", "docs": DOCS}]})
    with pytest.raises(ValueError, match="turn kind"):
        render_demo(tok, {"role": "solver", "question": "q", "turns": [{"kind": "model", "text": "x"}, {"kind": "tool"}]})


def sft_loss_sum(model, mb):
    """The SFT loss of a plain (non-DeepSpeed) model on one micro-batch, and its token count."""
    from training.algorithm.logprobs import sequence_logprobs
    from training.loop.sft import sft_loss
    lp, _ = sequence_logprobs(model, mb, 1.0)
    return sft_loss(lp, mb), int(mb.tensors["loss_mask"].sum())


def _grads(model, tok, demo):
    from training.algorithm.packing import pack_trajectories
    from training.loop.sft import demos_to_trajectories

    model.zero_grad()
    mb = pack_trajectories(demos_to_trajectories(tok, [demo], "auto", 384), 8192)[0]
    loss, n = sft_loss_sum(model, mb)
    (loss / n).backward()
    return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_masked_tokens_carry_no_gradient(tiny_model_dir, tok):
    """A trailing <information> block (mask 0) sits after every trained token, so it cannot change
    their context: if masked tokens carried any loss, adding it -- or filling it with other
    documents -- would change the loss or the gradient."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    base_loss, base_n, base = _grads(model, tok, solver_demo())
    other = [{"id": "9", "contents": "Zebra\n" + "striped horse " * 40, "score": 1.0}]
    for trailing in (DOCS, other):
        loss, n, g = _grads(model, tok, solver_demo(trailing_info=trailing))
        assert n == base_n and loss == pytest.approx(base_loss, abs=1e-5)
        assert g.keys() == base.keys()
        for k in base:
            torch.testing.assert_close(g[k], base[k], atol=1e-6, rtol=1e-5)
    # and the check has teeth: changing a *trained* token changes the gradient
    _, _, g2 = _grads(model, tok, solver_demo(a="Tosca"))
    assert any(not torch.allclose(g2[k], base[k], atol=1e-6) for k in base)


def test_sft_lowers_the_loss_and_exports(tiny_model_dir, tmp_path):
    data = tmp_path / "demos.jsonl"
    rows = [solver_demo(), proposer_demo(), solver_demo(q="Which opera did Bizet write in 1875?"), proposer_demo("Carmen")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "training.loop.sft", "--data", str(data), "--model_path", str(tiny_model_dir),
           "--output_dir", str(out), "--dtype", "fp32", "--batch_size", "4", "--epochs", "16", "--lr", "1e-3",
           "--warmup_steps", "0", "--lr_schedule", "constant", "--gradient_checkpointing", "false", "--tensorboard", "false"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 16
    assert losses[-1] < 0.7 * losses[0] and max(losses[-4:]) < min(losses[:4]), losses
    assert (out / "hf" / "model.safetensors").exists() and (out / "hf" / "tokenizer_config.json").exists()

    # the export holds the trained weights: its NLL on the demos is the last steps' loss, not the start's
    from transformers import AutoModelForCausalLM
    from training.algorithm.packing import pack_trajectories
    from training.loop.sft import demos_to_trajectories
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out / "hf")
    mb = pack_trajectories(demos_to_trajectories(tok, rows, "auto", 384), 8192)[0]
    with torch.no_grad():
        nll = [sft_loss_sum(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), mb) for d in (tiny_model_dir, out / "hf")]
    assert nll[1][0] / nll[1][1] < 0.7 * nll[0][0] / nll[0][1]


def test_sft_refuses_missing_data(tmp_path, tiny_model_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "training.loop.sft", "--data", str(tmp_path / "nope.jsonl"),
                        "--model_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "o")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "nope.jsonl does not exist" in r.stderr and "dataprep.coldstart" in r.stderr
    # run as a file it says how to run it, instead of a ModuleNotFoundError (it no longer edits sys.path)
    r = subprocess.run([sys.executable, str(ROOT / "training" / "loop" / "sft.py"), "--data", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "python -m training.loop.sft" in r.stderr, r.stderr


def test_sft_flags_are_train_py_declarations_with_their_own_defaults():
    """Issue 43 (4): no flag of sft.py is declared twice. Each group but its own is a train.py group (or one made from
    it by training/flags.derive_group): same help, same choices; only the defaults named here differ."""
    from dataclasses import fields

    from training.settings.config import GROUPS
    from training.loop.sft import SFT_GROUPS

    own_defaults = {"lr": 2e-5, "lr_schedule": "cosine", "warmup_steps": 2, "micro_token_budget": 4096,
                    "output_dir": "runs/sft", "sample_every": 0, "save_every": 0}
    for name, cls in SFT_GROUPS.items():
        if name == "sft":
            assert not {f.name for f in fields(cls)} & {f.name for g in GROUPS.values() for f in fields(g)}
            continue
        train = {f.name: f for f in fields(GROUPS[name])}
        for f in fields(cls):
            t = train[f.name]
            assert f.metadata["help"] == t.metadata["help"] and f.metadata.get("choices") == t.metadata.get("choices")
            if f.name in own_defaults:
                assert f.default == own_defaults[f.name] != t.default, f.name
            elif t.default is not dataclasses.MISSING:
                assert f.default == t.default, f.name
