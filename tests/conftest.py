"""Shared fixtures. Everything runs offline on CPU; GPU tests carry @pytest.mark.gpu."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Set before any heavy import (vLLM, DeepSpeed, transformers read these at import time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".torch_extensions"))

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent

from utils.dist import keep_unused_imports_out  # noqa: E402

keep_unused_imports_out()  # as the entry points do: no sklearn inside transformers, no mlflow inside DeepSpeed


# The heaviest test files, about longest first: one worker's seconds per file (setup, call and teardown summed from
# --durations=0) in a whole run of this order on a 2-core AVX-512 EPYC (2026-11-29: 1,093 s of pytest, 2,135
# worker-seconds, so 26 s over a perfect split of the two workers). Two multi-process tests running side by side
# slow each other, so a file's time moves by up to a half between runs. scripts/test.sh runs pytest on two workers
# (-n 2 --dist loadfile --no-loadscope-reorder): each worker is handed whole files in collection order, and takes its
# next file while it still has two tests left, so the long ones must start first or one worker ends the run alone.
# Only the order changes.
HEAVY_FIRST = ["tests/test_learning_proof_script.py",   # 150 s: the smoke SFT, rungs 1 and 2 at smoke scale
               "tests/training/test_trainer.py",        # 172 s: kill and resume, GAE and resume
               "tests/inference/test_rollout_schedule.py",  # 168 s: lockstep ranks, schedules out of order
               "tests/test_readme_gpu_quickstart.py",   # 87 s
               "tests/training/test_tp2_train.py",      # 90 s: four TP-2 launches
               "tests/test_demo_script.py",             # 106 s
               "tests/test_scripts.py",                 # 94 s: every per-size script's dry run
               "tests/training/test_modes.py",          # 82 s
               "tests/training/test_checkpoint.py",     # 117 s
               "tests/test_own_data_script.py",         # 70 s
               "tests/inference/test_tp2.py",           # 75 s
               "tests/training/test_update.py",
               "tests/training/test_learns.py",
               "tests/inference/test_eval_tp2.py",
               "tests/training/test_critic_update.py",
               "tests/training/test_hybrid_sleep.py",
               "tests/test_eval.py"]


def pytest_collection_modifyitems(config, items):
    rank = {str(REPO / name): i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: the rest keep their order
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def free_port() -> int:
    """A free 127.0.0.1 port. Test modules cannot import conftest under --import-mode=importlib:
    they use utils.dist.free_port, which this is."""
    from utils.dist import free_port as _fp
    return _fp()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors HF folder (converted once, cached in data/)."""
    from utils.assets import smollm2_dir
    return smollm2_dir()


def write_tiny_llama(smollm2: Path, out: Path, layers: int = 2) -> Path:
    """A tiny random Llama (hidden 128, head_dim 64: vLLM's CPU attention rejects head_dim 16) with SmolLM2's real
    tokenizer and chat template, written to `out`: float32 weights, saved as safetensors, so vLLM, HF and DeepSpeed
    all load it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, use_cache=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    gen = smollm2 / "generation_config.json"
    if gen.exists():
        shutil.copy(gen, out / "generation_config.json")
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny random Llama of 2 layers (write_tiny_llama)."""
    return write_tiny_llama(smollm2_dir, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def bm25_corpus(tmp_path_factory) -> Path:
    """A folder holding corpus.jsonl (the first 200 documents of data/corpus/wiki.jsonl) and bm25/, their BM25
    index: built once per session (per pytest worker) for the training tests' runs, which only read it.

    Built in a subprocess: bm25s imported into the test process breaks a later in-process vLLM engine's CPU
    kernel scan (docs/PLATFORM_NOTES.md, vLLM other CPU quirks)."""
    d = tmp_path_factory.mktemp("bm25_corpus")
    with (REPO / "data/corpus/wiki.jsonl").open() as f:
        corpus = [json.loads(next(f)) for _ in range(200)]
    (d / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus))
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(d / "corpus.jsonl"),
                    "--out", str(d / "bm25"), "--kind", "bm25"], cwd=REPO, check=True, capture_output=True)
    return d


# The smoke scale of the SFT cold start: one step on 8 demos, from a tiny random Llama of 12 layers (write_tiny_llama:
# the recipes train the top 8 layers, the SFT the top 12). The demo's and the ladder's smoke tests check their
# scripts' paths, not what a model learns, so they need no 135M model under every launch.
SMOKE_SFT = {"SFT_DEMOS": "8", "SFT_BATCH": "8"}
SMOKE_LAYERS = 12


@pytest.fixture(scope="session")
def smoke_sft(smollm2_dir, tmp_path_factory) -> Path:
    """scripts/sft_coldstart.sh at the smoke scale (SMOKE_SFT, BASE_MODEL a tiny random Llama), as
    scripts/demo_cpu.sh and scripts/learning_proof_cpu.sh call it, into a folder whose hf/ export both reuse when
    given it as SFT_DIR: made once for every pytest worker (the first to ask makes it under a lock; the others
    wait, then read it). Returns the folder; the script's output is in <folder>.out.

    The SFT is the one either script would make: the same demos, batch, seed, protocol and threads
    (OMP_NUM_THREADS), and the dtype measured on the machine (python -m utils.cpu_dtype)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    d = root / "smoke_sft"
    with open(root / "smoke_sft.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "hf" / "config.json").exists():
            tiny = root / "smoke_sft_base"
            if not (tiny / "config.json").exists():
                write_tiny_llama(smollm2_dir, tiny, layers=SMOKE_LAYERS)
            env = {**os.environ, **SMOKE_SFT, "BASE_MODEL": str(tiny),
                   "SFT_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            r = subprocess.run(["bash", "scripts/sft_coldstart.sh", str(d)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=900)
            Path(f"{d}.out").write_text(r.stdout)
            assert r.returncode == 0 and "-- SFT: 8 demos, batch 8" in r.stdout, r.stdout[-6000:]
    assert (d / "hf" / "config.json").exists() and (d / "hf" / "model.safetensors").exists()
    return d


# ----------------------------------------------------------------------------- faiss-gpu without a GPU

class FakeGpus:
    """faiss-gpu's get_num_gpus / index_cpu_to_all_gpus / index_cpu_to_gpus_list over `n` pretend GPUs."""

    def __init__(self, faiss, n: int):
        self.faiss, self.n, self.calls = faiss, n, []

    class GpuMultipleClonerOptions:
        shard = False
        useFloat16 = False

    def get_num_gpus(self) -> int:
        return self.n

    def index_cpu_to_all_gpus(self, index, co=None, ngpu=-1):
        return self.index_cpu_to_gpus_list(index, co=co, gpus=None, ngpu=ngpu, _via="all")

    def index_cpu_to_gpus_list(self, index, co=None, gpus=None, ngpu=-1, _via="list"):
        faiss = self.faiss
        gpus = list(range(self.n)) if gpus is None else list(gpus)
        assert all(0 <= g < self.n for g in gpus), f"faiss-gpu would fail on {gpus}"
        if len(gpus) > 1 and co is not None and co.shard:
            # faiss-gpu's ToGpuClonerMultiple::clone_Index_to_shards refuses anything else
            assert isinstance(index, faiss.IndexFlat) or faiss.try_extract_index_ivf(index) is not None, type(index)
        out = faiss.IndexShards(index.d, False, faiss.try_extract_index_ivf(index) is None)
        n, k, rows = index.ntotal, len(gpus), {}
        for i, g in enumerate(gpus):
            lo, hi = n * i // k, n * (i + 1) // k
            sub = faiss.clone_index(index)
            drop = np.concatenate([np.arange(0, lo), np.arange(hi, n)]).astype("int64")
            sub.remove_ids(faiss.IDSelectorBatch(drop))
            rows[g] = sub.ntotal
            out.add_shard(sub)
        self.calls.append({"via": _via, "gpus": gpus, "co": co, "index_type": type(index).__name__, "rows": rows})
        return out

    def install(self, monkeypatch):
        for name in ("get_num_gpus", "index_cpu_to_all_gpus", "index_cpu_to_gpus_list", "GpuMultipleClonerOptions"):
            monkeypatch.setattr(self.faiss, name, getattr(self, name), raising=False)
        return self


@pytest.fixture
def fake_faiss_gpus(monkeypatch):
    """fake_faiss_gpus(n): faiss-gpu's cloners over n pretend GPUs, each a real CPU shard (FakeGpus), installed
    on the faiss module for this test; `.calls` records every clone (GPUs, options, rows per GPU)."""
    import faiss

    return lambda n: FakeGpus(faiss, n).install(monkeypatch)
