"""Distributed helpers: process-group start-up that works the same on CPU (gloo) and GPU (nccl).

Every collective of this repo goes through the helpers below (tests/test_collectives_routed.py
refuses a direct torch.distributed call elsewhere). NCCL moves CUDA tensors only and gloo CPU
ones, so each helper puts its tensor on `collective_device(backend)` first. With a world of 1
(or no process group at all) the helpers degrade to local no-ops, so pure code can call them
unconditionally.
"""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoMlflowInDeepSpeedAutotuner:
    """A meta-path finder that refuses `import mlflow` to DeepSpeed's autotuner, and to no one else.

    `import deepspeed` imports deepspeed.autotuning.autotuner, which imports mlflow whenever it is
    installed (it is, for --report_to mlflow) and uses it only to log autotuning experiments, which
    this repo never runs. That import cost 2-3.5 s of CPU in every process that imports DeepSpeed
    (each rank of each launch). The autotuner catches the ImportError and sets has_mlflow = False;
    utils/trackers.py imports mlflow itself, which this finder lets through."""

    def find_spec(self, name, path=None, target=None):
        if name == "mlflow":
            f = sys._getframe(1)
            while f is not None:
                if f.f_globals.get("__name__") == "deepspeed.autotuning.autotuner":
                    raise ImportError("mlflow is not imported by DeepSpeed's autotuner here (utils/dist.py)")
                f = f.f_back
        return None  # not ours: the next finder looks


class _NoSklearnInTransformersGeneration:
    """A meta-path finder that keeps transformers' generation code from importing scikit-learn.

    transformers/generation/candidate_generator.py (imported by every model class) runs
    `from sklearn.metrics import roc_curve` whenever scikit-learn is installed (it is: sentence-transformers
    needs it), for assisted decoding's confidence-threshold tuning, which this repo never uses (vLLM and
    HFEngine generate without an assistant model). sklearn brings scipy and pandas: 1.2-1.3 CPU-s of every
    process that loads a model (each rank of each launch, each eval). When that module is about to be
    imported, this finder makes `transformers.utils.is_sklearn_available` (the name the module reads)
    answer False, and lets the import go on. Anyone else imports sklearn as usual."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformers.generation.candidate_generator":
            tu = sys.modules.get("transformers.utils")
            if tu is not None:
                tu.is_sklearn_available = _sklearn_not_for_generation
        return None  # not ours: the next finder looks


def _sklearn_not_for_generation() -> bool:
    return False


def keep_unused_imports_out() -> None:
    """Install _NoMlflowInDeepSpeedAutotuner and _NoSklearnInTransformersGeneration (once each) before DeepSpeed
    or transformers is imported."""
    for finder in (_NoMlflowInDeepSpeedAutotuner, _NoSklearnInTransformersGeneration):
        if not any(isinstance(f, finder) for f in sys.meta_path):
            sys.meta_path.insert(0, finder())


def prepare_launch_env() -> None:
    """What an entry point (train.py, training/loop/sft.py) sets before torch / DeepSpeed are imported:
    DeepSpeed's CPU accelerator where there is no GPU, quiet tokenizers, no warning line per
    ZeRO-3 gather / reduce-scatter (DeepSpeed 0.19 calls deprecated torch collectives there), and
    no mlflow import inside DeepSpeed's nor sklearn inside transformers' (keep_unused_imports_out)."""
    import warnings

    keep_unused_imports_out()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*is deprecated")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def setup_env_for_single_process() -> None:
    """Plain `python train.py` (no launcher): DeepSpeed then tries mpi4py discovery and
    fails on the import (docs/PLATFORM_NOTES.md, DeepSpeed on CPU). Pretend to be rank 0 of a world of 1 instead."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def disable_ds_shm_op() -> None:
    """DeepSpeed JIT-builds `deepspeed_shm_comm` on every fresh CPU start (75-90 s). The op only
    speeds up intra-node CPU collectives, which gloo does anyway. It must be patched on the
    module object in sys.modules: `import deepspeed.comm.torch as m` returns torch (docs/PLATFORM_NOTES.md,
    DeepSpeed on CPU)."""
    import deepspeed.comm.torch  # noqa: F401  (registers the module)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def default_backend(cuda_available: bool) -> str:
    """The process-group backend for a machine: nccl with CUDA (DeepSpeed's ZeRO collectives move
    CUDA tensors), gloo without."""
    return "nccl" if cuda_available else "gloo"


def local_device() -> str:
    """This rank's compute device: its GPU (LOCAL_RANK) when CUDA is present, else the CPU."""
    import torch
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def collective_device(backend: str, cuda_index: int = 0) -> str:
    """Where a tensor must live for a collective of `backend`: NCCL accepts CUDA tensors only;
    gloo (and a mixed "cpu:gloo,cuda:nccl" group, for its CPU tensors) takes CPU ones."""
    return f"cuda:{cuda_index}" if backend == "nccl" else "cpu"


def init_distributed(backend: str | None = None) -> None:
    """Start the default process group before anything else. vLLM created first with TP=1
    would set up a group of world size 1 and DeepSpeed would then fail (docs/PLATFORM_NOTES.md,
    Hybrid engine rules)."""
    import torch
    import torch.distributed as dist

    setup_env_for_single_process()
    if dist.is_initialized():
        return
    keep_unused_imports_out()
    import deepspeed

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        disable_ds_shm_op()
    else:  # untested on GPU (no GPU in CI): pin the rank's device before NCCL starts, as torch's docs ask
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend=backend or default_backend(cuda))


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def _multi_rank() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_tensor(t, op: str = "sum"):
    """All-reduce `t` in place over ranks (op: "sum" or "max") and return it; a no-op on a single
    process. The tensor is copied to the backend's device and back when they differ."""
    import torch
    import torch.distributed as dist
    if not _multi_rank():
        return t
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    device = torch.device(collective_device(dist.get_backend(), index))
    # Untested on GPU (no GPU in CI): under NCCL a CPU tensor travels through a CUDA copy.
    buf = t if t.device == device and t.is_contiguous() else t.contiguous().to(device)
    dist.all_reduce(buf, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    if buf is not t:
        t.copy_(buf)
    return t


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a list of floats over ranks (float64, so counts stay exact)."""
    import torch
    if not _multi_rank():
        return [float(v) for v in values]
    return all_reduce_tensor(torch.tensor(values, dtype=torch.float64), "sum").tolist()


def all_reduce_max(value: int | float) -> float:
    """Max of a number over ranks (float64: integers up to 2**53 stay exact)."""
    import torch
    if not _multi_rank():
        return value
    return all_reduce_tensor(torch.tensor([value], dtype=torch.float64), "max").item()


def gather_to_main(t):
    """Every rank's `t` (same shape and dtype everywhere) on rank 0, in rank order; None on the other
    ranks, which allocate nothing for it (an all-gather would give each of them the whole output).
    The tensors travel through the backend's device when they live elsewhere."""
    import torch
    import torch.distributed as dist
    if not _multi_rank():
        return [t]
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    device = torch.device(collective_device(dist.get_backend(), index))
    # Untested on GPU (no GPU in CI): under NCCL a CPU tensor (offloaded parameters) travels through a CUDA copy.
    buf = t if t.device == device and t.is_contiguous() else t.contiguous().to(device)
    main = dist.get_rank() == 0
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())] if main else None
    dist.gather(buf, out, dst=0)
    return out


def all_gather_object(obj):
    """Every rank's `obj`, in rank order. NCCL pickles through the current CUDA device,
    which init_distributed pins (torch's docs ask for it)."""
    import torch.distributed as dist
    if not _multi_rank():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
