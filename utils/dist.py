"""Distributed helpers: process-group start-up that works the same on CPU (gloo) and GPU (nccl).

Every collective goes through torch.distributed; with a world of 1 (or no
process group at all) the helpers degrade to local no-ops, so pure code can
call them unconditionally.
"""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_launch_env() -> None:
    """What an entry point (train.py, training/sft.py) sets before torch / DeepSpeed are imported:
    DeepSpeed's CPU accelerator where there is no GPU, quiet tokenizers, and no warning line per
    ZeRO-3 gather / reduce-scatter (DeepSpeed 0.19 calls deprecated torch collectives there)."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*is deprecated")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def setup_env_for_single_process() -> None:
    """Plain `python train.py` (no launcher): DeepSpeed then tries mpi4py discovery and
    fails on the import (PLATFORM.md). Pretend to be rank 0 of a world of 1 instead."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def disable_ds_shm_op() -> None:
    """DeepSpeed JIT-builds `deepspeed_shm_comm` on every fresh CPU start (75-90 s). The op only
    speeds up intra-node CPU collectives, which gloo does anyway. It must be patched on the
    module object in sys.modules: `import deepspeed.comm.torch as m` returns torch (PLATFORM.md)."""
    import deepspeed.comm.torch  # noqa: F401  (registers the module)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def init_distributed(backend: str | None = None) -> None:
    """Start the default process group before anything else. vLLM created first with TP=1
    would set up a group of world size 1 and DeepSpeed would then fail (PLATFORM.md)."""
    import torch
    import torch.distributed as dist

    setup_env_for_single_process()
    if dist.is_initialized():
        return
    import deepspeed

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        disable_ds_shm_op()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend=backend)
    if torch.cuda.is_available():  # untested on GPU in CI: standard per-rank device pinning
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a list of floats over ranks (float64, so counts stay exact)."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(value: int | float) -> float:
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_gather_object(obj):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
