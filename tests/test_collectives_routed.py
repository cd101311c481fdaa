"""Every collective goes through utils/dist.py, which puts tensors on the backend's device
(NCCL accepts CUDA tensors only). A direct torch.distributed / deepspeed.comm collective anywhere
else is how the GPU path once crashed at its first all-reduce of a CPU tensor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {Path("utils/dist.py")}
SKIP_DIRS = {"tests", ".venv", "data", "runs", "outputs", ".torch_extensions"}
DIST_MODULES = ("torch.distributed", "deepspeed.comm")
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "_all_gather_base", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "inference_all_reduce",
}


def _sources() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.py")
                  if not (set(p.relative_to(REPO).parts[:-1]) & SKIP_DIRS or p.relative_to(REPO).parts[0].startswith(".")))


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of each call to a torch.distributed / deepspeed.comm collective, through any
    import alias: `import torch.distributed as dist`, `from torch import distributed`, `import torch`
    then `torch.distributed.x(...)`, `from torch.distributed import all_reduce as ar`, ..."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts, f = [], node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or f.id not in alias:
            continue
        name = ".".join([alias[f.id], *reversed(parts)])
        module, _, fn = name.rpartition(".")
        if module in DIST_MODULES and fn in COLLECTIVES:
            hits.append((node.lineno, name))
    return hits


@pytest.mark.parametrize("src, n", [
    ("import torch.distributed as dist\ndist.all_reduce(t)", 1),
    ("import torch.distributed as dist\ndef f():\n    dist.barrier()\n    dist.all_gather_object(o, x)", 2),
    ("import torch\ntorch.distributed.broadcast(t, 0)", 1),
    ("from torch import distributed as d\nd.reduce_scatter_tensor(a, b)", 1),
    ("from torch.distributed import all_reduce as ar\nar(t)", 1),
    ("import deepspeed.comm as dist\ndist.all_gather_into_tensor(a, b)", 1),
    ("import deepspeed\ndeepspeed.comm.barrier()", 1),
    # not collectives: queries, other modules' gather, the wrappers themselves
    ("import torch.distributed as dist\ndist.get_world_size(); dist.is_initialized()", 0),
    ("import torch, asyncio\nx.gather(1, i); torch.gather(x, 1, i); asyncio.gather(a)", 0),
    ("from utils import dist as D\nD.all_reduce_sum([1.0]); D.barrier()", 0),
])
def test_the_scanner_finds_direct_calls(src, n):
    assert len(direct_collectives(src)) == n


def test_the_scan_covers_the_training_code():
    names = {p.relative_to(REPO).as_posix() for p in _sources()}
    assert {"train.py", "training/loop/trainer.py", "training/algorithm/packing.py", "training/algorithm/advantages.py",
            "training/engine/checkpoint.py", "inference/engines.py"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_no_module_calls_a_collective_directly():
    bad = [f"{p.relative_to(REPO)}:{line}: {name}" for p in _sources() if p.relative_to(REPO) not in ALLOWED
           for line, name in direct_collectives(p.read_text(encoding="utf-8"))]
    assert not bad, "call utils.dist (it puts tensors on the backend's device) instead of:\n  " + "\n  ".join(bad)
