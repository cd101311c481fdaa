"""The actor's weights as a plain HF folder, in save_pretrained's format, written while training runs under ZeRO-3.

    <folder>/model-0000k-of-0000N.safetensors + model.safetensors.index.json (one model.safetensors when it fits
    in one shard), config, generation config, tokenizer

Each parameter's partitions are gathered to rank 0 alone and streamed into its shard at its offset, so no rank
holds more than about one tensor beyond its own partitions (bench/RESULTS.md, section export). A checkpoint keeps
one under <tag>/hf/ (training/engine/checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from inference.layer_buckets import group_by_layer
from utils import dist as D

DEFAULT_MAX_SHARD_SIZE = "5GB"  # per safetensors file of the HF export (save_pretrained's own default is 50GB)

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class _ShardWriter:
    """Streams tensors into the safetensors files of a shard plan, in any order. Each file's header
    is known from the plan (names, dtypes, full shapes), so it is written when the file is opened
    and every tensor's bytes go straight to their offset: nothing is held beyond the tensor being
    written. Layout as safetensors itself lays it out (by dtype size, then name, no gaps)."""

    def __init__(self, folder: Path, filename_to_tensors: dict[str, list[str]], metas: dict[str, torch.Tensor]):
        self.folder, self.metas = folder, metas
        self.files: dict[str, dict] = {}
        self.file_of: dict[str, str] = {}
        for fname, names in filename_to_tensors.items():
            names = sorted(names, key=lambda k: (-metas[k].element_size(), k))
            header, offsets, pos = {}, {}, 0
            for k in names:
                t = metas[k]
                end = pos + t.numel() * t.element_size()
                header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, end]}
                offsets[k], pos = pos, end
                self.file_of[k] = fname
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
            self.files[fname] = {"header": raw, "offsets": offsets, "left": set(names), "size": pos, "fh": None}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        f = self.files[self.file_of[name]]
        meta = self.metas[name]
        if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
            raise RuntimeError(f"export: {name} gathered as {tuple(tensor.shape)} {tensor.dtype}, planned as "
                               f"{tuple(meta.shape)} {meta.dtype}")
        if f["fh"] is None:
            f["fh"] = open(self.folder / self.file_of[name], "wb")
            f["fh"].write(len(f["header"]).to_bytes(8, "little") + f["header"])
            f["start"] = 8 + len(f["header"])
        cpu = tensor.detach().to("cpu").contiguous()  # a GPU tensor: one tensor's copy at a time
        f["fh"].seek(f["start"] + f["offsets"][name])
        f["fh"].write(cpu.reshape(-1).view(torch.uint8).numpy())
        f["left"].discard(name)
        if not f["left"]:
            f["fh"].truncate(f["start"] + f["size"])
            f["fh"].close()

    def close(self) -> None:
        missing = sorted(k for f in self.files.values() for k in f["left"])
        if missing:
            raise RuntimeError(f"export: {len(missing)} planned tensors were never written, e.g. {missing[:3]}")


_LIBC = None  # glibc, loaded on first use; False where there is none


def _trim_heap() -> None:
    """Hand the pages of a released CPU gather back to the OS (glibc only; elsewhere a no-op). The
    allocator otherwise keeps freed layer buffers resident and scattered over arenas, and RSS
    climbed to ~3x the largest group over one export instead of staying at one group's gather."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _full_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the full (unpartitioned) shape: ZeRO-3 keeps it in ds_shape."""
    return torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta")


def _gather_to_main(p: torch.Tensor) -> torch.Tensor | None:
    """The full tensor of a ZeRO-3 parameter on rank 0 (None on the others), from every rank's
    partition (ds_tensor: equal slices of the flattened tensor in rank order, the last one padded),
    so no other rank ever holds more than its own slice. Bytes travel (gloo gathers any dtype)."""
    part = getattr(p, "ds_tensor", None)
    if part is None:  # not partitioned (ZeRO-3 off): every rank holds it whole
        return p.data if D.is_main() else None
    parts = D.gather_to_main(part.data.reshape(-1).view(torch.uint8))
    if parts is None:
        return None
    return torch.cat(parts).view(p.dtype)[:p.ds_numel].view(p.ds_shape)


def export_hf(module, tokenizer_dir: str | Path, out_dir: str | Path, *,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a plain HF folder of the actor's current weights, in save_pretrained's format:
    model-0000k-of-0000N.safetensors + model.safetensors.index.json (or one model.safetensors).
    Collective: each parameter's partitions are gathered to rank 0 alone (not all-gathered), which
    writes it and lets it go, so rank 0's extra memory is about one tensor and the other ranks'
    nothing beyond their own partitions (bench/RESULTS.md, section export). Layer groups (a decoder
    layer, or a run of non-layer tensors) are where the CPU heap is trimmed."""
    from huggingface_hub import split_torch_state_dict_into_shards

    out_dir = Path(out_dir)
    params = list(module.named_parameters())  # tied weights appear once, as save_pretrained writes them
    in_state = set(module.state_dict().keys())
    buffers = [(n, b) for n, b in module.named_buffers() if n in in_state]  # persistent ones; never partitioned
    metas = {n: _full_meta(t) for n, t in params + buffers}
    plan = split_torch_state_dict_into_shards(metas, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)
    main = D.is_main()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = _ShardWriter(tmp, plan.filename_to_tensors, metas)
    for group in group_by_layer(params):
        for name, p in group:
            full = _gather_to_main(p)
            if main:
                writer.write(name, full)
            del full
        if all(p.device.type == "cpu" for _, p in group):
            _trim_heap()
    if main:
        for name, b in buffers:
            writer.write(name, b)
        writer.close()
        if plan.is_sharded:
            n_params = sum(metas[n].numel() for n, _ in params)
            index = {"metadata": {"total_parameters": n_params, **plan.metadata}, "weight_map": plan.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        from transformers import AutoTokenizer

        module.config.save_pretrained(tmp)
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        old = out_dir.with_name(out_dir.name + ".old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return out_dir
