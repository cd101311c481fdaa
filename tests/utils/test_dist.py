"""utils.dist: the backend / device choice (a pure function, so it is tested on CPU), and the
collective helpers, in a world of one and over two real gloo ranks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from utils import dist as D

REPO = Path(__file__).resolve().parents[2]


def test_backend_follows_cuda():
    assert D.default_backend(cuda_available=True) == "nccl"
    assert D.default_backend(cuda_available=False) == "gloo"


@pytest.mark.parametrize("backend, index, device", [
    ("nccl", 0, "cuda:0"), ("nccl", 3, "cuda:3"),   # NCCL moves CUDA tensors only
    ("gloo", 0, "cpu"), ("gloo", 3, "cpu"),
    ("cpu:gloo,cuda:nccl", 1, "cpu"),                # a mixed group serves CPU tensors with gloo
])
def test_collective_device_per_backend(backend, index, device):
    assert D.collective_device(backend, index) == device


def test_every_cuda_machine_gets_a_backend_whose_device_is_cuda():
    """The pair init_distributed starts with: nccl on CUDA must reduce on CUDA; gloo on CPU."""
    assert D.collective_device(D.default_backend(True), 2).startswith("cuda")
    assert D.collective_device(D.default_backend(False)) == "cpu"


def test_helpers_without_a_process_group_are_local():
    assert D.all_reduce_sum([1, 2.5]) == [1.0, 2.5]
    assert D.all_reduce_max(7) == 7
    t = torch.tensor([1.0, 2.0])
    assert D.all_reduce_tensor(t) is t and t.tolist() == [1.0, 2.0]
    assert D.all_gather_object({"a": 1}) == [{"a": 1}]
    D.barrier()
    assert (D.rank(), D.world_size(), D.is_main()) == (0, 1, True)


def test_under_nccl_no_cpu_tensor_reaches_the_collective(monkeypatch):
    """A fake NCCL group of 2: every helper (and the packing / advantage fallbacks that route through
    them) must hand all_reduce a CUDA tensor. Without CUDA the move itself fails, which is fine: the
    bug was the CPU tensor reaching NCCL ("No backend type associated with device type cpu")."""
    import torch.distributed as dist

    from training.algorithm.advantages import _all_reduce_sum
    from training.algorithm.packing import global_max

    seen: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: seen.append(t.device.type))
    calls = [lambda: D.all_reduce_sum([1.0]), lambda: D.all_reduce_max(3), lambda: D.all_reduce_tensor(torch.ones(2)),
             lambda: global_max(4), lambda: _all_reduce_sum(torch.ones(3), None)]
    for call in calls:
        try:
            call()
        except (AssertionError, RuntimeError) as e:  # CPU-only torch: "Torch not compiled with CUDA enabled"
            assert "CUDA" in str(e), e
    assert "cpu" not in seen
    if torch.cuda.is_available():
        assert seen == ["cuda"] * len(calls)


_TWO_RANKS = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.environ["REPO"])
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from utils import dist as D
    from training.algorithm.packing import global_max
    from training.algorithm.advantages import _all_reduce_sum

    def run(rank, store):
        # A file store: no TCP port to race other processes for on a shared machine.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        out = {"sum": D.all_reduce_sum([rank + 1, 2 ** 40 + rank]), "max": D.all_reduce_max(10 * rank + 3)}
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * (rank + 1)   # non-contiguous, in place
        D.all_reduce_tensor(t, "sum")
        out["tensor"] = t.tolist()
        m = torch.tensor([float(rank), 5.0 - rank])
        out["tmax"] = D.all_reduce_tensor(m, "max").tolist()
        out["objects"] = D.all_gather_object(f"r{rank}")
        out["packing"] = global_max(7 if rank else 2)
        out["advantages"] = _all_reduce_sum(torch.tensor([1.0, rank]), None).tolist()
        D.barrier()
        with open(f"{store}.rank{rank}", "w") as f:   # one file per rank: forked ranks share stdout
            f.write(repr(out))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.start_processes(run, args=(sys.argv[1],), nprocs=2, start_method="fork")   # fork: no second torch import
""")


@pytest.mark.timeout(120)
def test_helpers_over_two_gloo_ranks(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    env = dict(os.environ, REPO=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        out = ast.literal_eval((tmp_path / f"store.rank{rank}").read_text())
        assert out["sum"] == [3.0, 2.0 ** 41 + 1]          # float64: 2**41 + 1 stays exact
        assert out["max"] == 13.0
        assert out["tensor"] == [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]]
        assert out["tmax"] == [1.0, 5.0]
        assert out["objects"] == ["r0", "r1"]
        assert out["packing"] == 7
        assert out["advantages"] == [2.0, 1.0]


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """DeepSpeed's autotuner imports mlflow when it is installed (2-3.5 s of CPU in every rank of every launch);
    after prepare_launch_env it finds none and sets has_mlflow = False, while the trackers can still import it."""
    import importlib.util

    autotuner = Path(importlib.util.find_spec("deepspeed").origin).parent / "autotuning" / "autotuner.py"
    assert "import mlflow" in autotuner.read_text()  # the premise: if DeepSpeed drops the import, drop the finder
    code = textwrap.dedent("""
        import sys
        from utils.dist import prepare_launch_env
        prepare_launch_env()
        prepare_launch_env()  # installed once
        import deepspeed  # noqa: F401
        from deepspeed.autotuning import autotuner
        from utils.dist import _NoMlflowInDeepSpeedAutotuner as F
        print(autotuner.has_mlflow, "mlflow" in sys.modules, sum(isinstance(f, F) for f in sys.meta_path))
        import mlflow
        print(mlflow.__name__)
    """)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-3:-1] == ["False False 1", "mlflow"], r.stdout


def test_a_model_loads_without_sklearn_which_stays_importable():
    """transformers' generation code imports sklearn when it is installed (1.2-1.3 s of CPU in every process that
    loads a model); after keep_unused_imports_out a model class loads and runs without it, and sklearn itself
    still imports. Without the finder the same lines import sklearn (the control)."""
    import importlib.util

    gen = Path(importlib.util.find_spec("transformers").origin).parent / "generation" / "candidate_generator.py"
    assert "from sklearn.metrics import roc_curve" in gen.read_text()  # the premise: if it goes, drop the finder
    code = textwrap.dedent("""
        import sys
        if sys.argv[1] == "lean":
            from utils.dist import keep_unused_imports_out
            keep_unused_imports_out()
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
        out = LlamaForCausalLM(cfg).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4,
                                             do_sample=False)  # an unseeded random model hit EOS early in CI
        print(out.shape[1], "sklearn" in sys.modules)
        import sklearn.metrics
        print(sklearn.metrics.roc_curve.__name__)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    got = {}
    for mode in ("lean", "plain"):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got[mode] = r.stdout.split("\n")[-3:-1]
    assert got == {"lean": ["7 False", "roc_curve"], "plain": ["7 True", "roc_curve"]}, got
