"""Checkpoints that resume a crashed run exactly, the run folder's ownership, and a sharded HF export.

Layout under <output_dir>/:
    config.json                 the run's resolved config; a later launch with run-defining
                                differences is refused unless --overwrite true (`claim_output_dir`)
    checkpoints/run_id          the id of the run that owns this folder
    checkpoints/step_000010/    DeepSpeed save_checkpoint tag (ZeRO shards, optimizer, scheduler)
        run_id                  written first: rotation deletes only folders carrying this run's id
        trainer_rank{r}.pt      per-rank client state: step, RNG states, data cursor, question pool,
                                EMA baselines, curriculum; plain types only, read with weights_only=True
        hf/                     HF export: model-0000k-of-0000N.safetensors + model.safetensors.index.json
                                (one model.safetensors when it fits in one shard), config, tokenizer
        critic/, critic_hf/     the PPO critic's DeepSpeed tag; its HF export with --export_critic
    checkpoints/latest          the newest *complete* tag, written last and atomically
    .rank0_marker               a random token rank 0 writes at start-up: every rank must read it
                                back, or the launch is refused (`check_shared_output_dir`)

A run killed mid-save leaves `latest` on the previous complete checkpoint, so `--resume auto`
never loads a half-written one; the half-written folder carries this run's id and is replaced
when the resumed run saves that step again. What the folder answers read-only (may a launch use it,
which complete checkpoint it resumes from, the newest complete one when `latest` is damaged) is
training/run_state.py's; this module writes, rotates and deletes.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
import uuid
from collections import deque
from pathlib import Path

import numpy as np
import torch

from inference.layer_buckets import group_by_layer
from training.config import ConfigError
from training.run_state import (OPERATIONAL, RUN_ID, STARTED_OVER, TAG_RE, ResumeError, run_owner,  # noqa: F401 - re-exported
                                 ckpt_root, config_diff, config_diff_all, find_resume, output_dir_verdict, resume_offer,
                                 tag_for)
from utils import dist as D

DEFAULT_MAX_SHARD_SIZE = "5GB"  # per safetensors file of the HF export (save_pretrained's own default is 50GB)


def fault_point(where: str, step: int) -> None:
    """Crash injection for the tests: SSP_FAULT=in_save:2 kills the process (no clean-up, like a
    node failure) in the middle of writing checkpoint 2 (same variable as the trainer's points)."""
    if os.environ.get("SSP_FAULT", "") == f"{where}:{step}":
        print(f"SSP_FAULT: killing rank {D.rank()} at {where} of step {step}", flush=True)
        os._exit(17)


# ----------------------------------------------------------------------------- the run folder

def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_id(output_dir: str | Path) -> str:
    """This folder's run id; a folder without one (an SFT run, or one made before run ids) gets one now."""
    root = ckpt_root(output_dir)
    rid = run_owner(root)
    if rid is None:
        root.mkdir(parents=True, exist_ok=True)
        rid = _new_run_id()
        _write_atomic(root / RUN_ID, rid + "\n")
    return rid


def _trash(path: Path) -> None:
    """Delete a checkpoint folder: renamed first (atomic), so a crash mid-delete never leaves a
    half-deleted folder that still looks like a checkpoint."""
    gone = path.with_name(path.name + ".trash")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def claim_output_dir(output_dir: str | Path, config: dict) -> str:
    """Rank 0's part of `prepare_output_dir`, for the resolved `config` (Config.to_dict()): decide
    whether this launch continues the run in output_dir, starts over in it (only with --overwrite),
    or is refused; write config.json and the run id; return the run id. Refuses (ConfigError) when
    config.json differs in a run-defining field, when checkpoints exist without a config.json, and
    when --resume none would start over on top of the run's checkpoints."""
    resume = config["checkpointing"]["resume"]
    out, root = Path(output_dir), ckpt_root(output_dir)
    cfg_file = out / "config.json"
    v = output_dir_verdict(out, config)  # training/run_state.py: the same verdict --dry_run reads
    if v.refusal:
        raise ConfigError(v.refusal)
    old, diffs, has_ckpt = v.old, v.diffs, v.has_ckpt
    prev = run_owner(root)
    if v.starts_over:
        # an explicit --resume folder inside this run is kept: it is what the new start loads
        keep = Path(resume).resolve() if resume not in ("auto", "none") else None
        deleted = 0
        if prev is not None and root.is_dir():
            for p in sorted(root.iterdir()):
                if p.is_dir() and TAG_RE.match(p.name) and run_owner(p) == prev and p.resolve() != keep:
                    _trash(p)
                    deleted += 1
        (root / "latest").unlink(missing_ok=True)
        for name in STARTED_OVER:
            p = out / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        print(f"--overwrite: starting over in {out}; deleted {deleted} checkpoint(s) of run {prev} and its logs "
              f"(folders of other runs are kept)", flush=True)
        prev = None
    elif isinstance(old, dict):
        changed = {k: d for k, d in config_diff_all(old, config).items() if k not in diffs}
        if changed:
            print("config.json: operational fields changed since the last launch: "
                  + ", ".join(f"{k} {o!r} -> {n!r}" for k, (o, n) in sorted(changed.items())), flush=True)
    elif not has_ckpt:
        prev = None  # a fresh run in this folder
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(cfg_file, json.dumps(config, indent=2) + "\n")
    rid = prev or _new_run_id()
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(root / RUN_ID, rid + "\n")
    return rid


def prepare_output_dir(cfg) -> str:
    """Create output_dir and write config.json, or refuse a folder that holds another run (see
    `claim_output_dir`). Collective: rank 0 decides, every rank raises the same ConfigError or
    returns the same run id."""
    verdict = None
    if D.is_main():
        try:
            verdict = ("ok", claim_output_dir(cfg.logging.output_dir, cfg.to_dict()))
        except ConfigError as e:
            verdict = ("refused", str(e))
    kind, value = D.all_gather_object(verdict)[0]
    if kind == "refused":
        raise ConfigError(value)
    check_shared_output_dir(cfg.logging.output_dir)
    return value


MARKER = ".rank0_marker"


def _marker_dir(output_dir: str | Path) -> Path:
    """Where this rank looks for rank 0's marker: output_dir, except under the test hook
    SSP_FAULT=unshared_output_dir:<rank>, which sends that rank to an empty folder of its own, as
    if its node had a local disk where the others have theirs (fault_point's variable and style)."""
    fault = os.environ.get("SSP_FAULT", "")
    if fault == f"unshared_output_dir:{D.rank()}":
        print(f"SSP_FAULT: rank {D.rank()} looks for the marker in a folder of its own", flush=True)
        return Path(output_dir).with_name(Path(output_dir).name + f".rank{D.rank()}-local")
    return Path(output_dir)


def check_shared_output_dir(output_dir: str | Path, wait_s: float | None = None) -> None:
    """Refuse an --output_dir that not every rank sees as the same folder. Checkpoints are written
    by every rank into one folder and resume reads it back on every rank, so a node-local disk
    (each node its own `runs/x`) would leave each node with a part of every checkpoint. Rank 0
    writes a fresh random token to output_dir/.rank0_marker and sends it to every rank; each rank
    reads the file (retrying up to `wait_s`, SSP_MARKER_WAIT_S or 10 s, for a network
    filesystem's attribute cache) and all ranks gather who could not, so every rank raises the
    same ConfigError, naming the first such rank and its host. Collective."""
    import socket

    if D.world_size() == 1:
        return
    token = None
    if D.is_main():
        token = uuid.uuid4().hex
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        _write_atomic(Path(output_dir) / MARKER, token + "\n")
    token = D.all_gather_object(token)[0]
    wait_s = float(os.environ.get("SSP_MARKER_WAIT_S", 10)) if wait_s is None else wait_s
    path, deadline, seen = _marker_dir(output_dir) / MARKER, time.monotonic() + wait_s, None
    while True:
        try:
            seen = path.read_text().strip()
        except OSError:
            seen = None
        if seen == token or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    bad = [(r, host) for r, ok, host in D.all_gather_object((D.rank(), seen == token, socket.gethostname())) if not ok]
    if bad:
        r, host = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise ConfigError(f"--output_dir {output_dir} is not shared between nodes: rank {r} on host {host}{more} "
                          f"cannot see rank 0's marker ({MARKER}); checkpoints and resume need a filesystem every "
                          f"node mounts (NFS, Lustre, ...): pass an --output_dir on one")


# ----------------------------------------------------------------------------- client state

def rng_state() -> dict:
    """Python, numpy and torch RNG states as plain types and tensors (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    n = np.random.get_state(legacy=False)
    return {"python": [version, list(internal), gauss],
            "numpy": {"bit_generator": n["bit_generator"], "key": n["state"]["key"].tolist(), "pos": int(n["state"]["pos"]),
                      "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])},
            "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    n = s["numpy"]
    if isinstance(n, dict):
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    else:  # a legacy tuple, from a checkpoint loaded with SSP_TRUST_CHECKPOINT=1
        np.random.set_state(n)
    torch.set_rng_state(s["torch"])


def plain_state(obj, where: str = "state"):
    """`obj` as what torch.load(weights_only=True) reads back: dicts, lists, tuples, str, int,
    float, bool, None and CPU tensors. numpy values become python ones and deques lists; anything
    else raises TypeError naming its place, before a checkpoint is written."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {plain_state(k, f"{where} key"): plain_state(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, deque)):
        return [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"checkpoint {where} is a {type(obj).__name__}, which torch.load(weights_only=True) cannot "
                    f"read back; store it as plain types (dict/list/str/int/float/bool/None) or tensors")


def read_client_state(path: Path) -> dict:
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if os.environ.get("SSP_TRUST_CHECKPOINT") == "1":
            return torch.load(path, weights_only=False)
        raise RuntimeError(
            f"{path} holds objects other than plain types and tensors, so it is not loaded (torch.load "
            f"weights_only=True; an older version of this trainer wrote numpy RNG states this way). If you trust the "
            f"file, set SSP_TRUST_CHECKPOINT=1 once; the next checkpoint is written in the safe form.\n{e}") from e
    except (OSError, RuntimeError) as e:  # a truncated zip: "[Errno 22] Invalid argument" / "failed finding central directory"
        raise ResumeError(f"{path} cannot be read ({e}): the checkpoint {path.parent} is damaged. "
                          f"{resume_offer(path.parent.parent, skip=(path.parent.name,))}") from None


# ----------------------------------------------------------------------------- HF export

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


# ----------------------------------------------------------------------------- save / resume

def _make_room(path: Path, rid: str, latest: str | None) -> None:
    """Before writing checkpoint `path`: a folder of this run under that name is a half-written
    one from a killed save (it cannot be `latest`), so it goes; a folder of another run or of
    none (copied in by hand) is moved aside, never written into or deleted."""
    if not path.exists() or path.name == latest:
        return
    if run_owner(path) == rid:
        _trash(path)
        return
    k, aside = 0, path.with_name(path.name + ".not-this-run")
    while aside.exists():
        k += 1
        aside = path.with_name(f"{path.name}.not-this-run{k}")
    owner = run_owner(path) or "no run id"
    os.replace(path, aside)
    print(f"[warn] {path} belongs to another run ({owner}); moved it to {aside.name} so this run's "
          f"checkpoint does not overwrite it", flush=True)


def save(engine, output_dir: str | Path, step: int, client_state: dict, *, tokenizer_dir: str | Path,
         export: bool = True, max_ckpts: int = 2, extra: dict | None = None) -> Path:
    """Save everything needed to resume at `step` (the number of finished steps), and each of `extra`
    {name: engine} (the critic) in <tag>/<name>/ (its ZeRO shards, optimizer, scheduler). Collective."""
    root = ckpt_root(output_dir)
    tag = tag_for(step)
    path = root / tag
    state = plain_state(dict(client_state, step=step, rng=rng_state(), world_size=D.world_size()))
    if D.is_main():
        rid = run_id(output_dir)
        latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
        _make_room(path, rid, latest)
        path.mkdir(parents=True, exist_ok=True)
        (path / RUN_ID).write_text(rid + "\n")  # first: a folder killed mid-save is still known as this run's
    D.barrier()
    path.mkdir(parents=True, exist_ok=True)  # ranks on other nodes without a shared filesystem
    torch.save(state, path / f"trainer_rank{D.rank()}.pt")
    if export:
        export_hf(engine.module, tokenizer_dir, path / "hf")
    fault_point("in_save", step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    for name, e in (extra or {}).items():  # before `latest`: a checkpoint without its critic is incomplete
        e.save_checkpoint(str(path), tag=name, save_latest=False)
    D.barrier()
    if D.is_main():
        _write_atomic(root / "latest", tag + "\n")  # the commit point
        _rotate(root, keep=max_ckpts)
    D.barrier()
    return path


def _rotate(root: Path, keep: int) -> None:
    """Keep this run's `keep` newest checkpoints (and `latest`); delete only folders that carry
    this run's id. Folders copied in by hand or left by another run are never touched."""
    rid = run_owner(root)
    if keep <= 0 or rid is None:
        return
    for p in root.glob("step_*.trash"):  # a rotation killed mid-delete
        shutil.rmtree(p, ignore_errors=True)
    ours = sorted((int(m.group(1)), p) for p in root.iterdir()
                  if p.is_dir() and (m := TAG_RE.match(p.name)) and run_owner(p) == rid)
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    for _, p in ours[:-keep]:
        if p.name != latest:
            _trash(p)


def load(engine, path: Path, extra: dict | None = None) -> dict:
    """Restore engine and each of `extra` {name: engine} (params, optimizer, scheduler); return this rank's
    client state, with the RNG states already applied. Collective."""
    for where, tag, e in [(path.parent, path.name, engine)] + [(path, n, e) for n, e in (extra or {}).items()]:
        if e.load_checkpoint(str(where), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)[0] is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint at {where / tag}")
    own = path / f"trainer_rank{D.rank()}.pt"
    state = read_client_state(own if own.exists() else path / "trainer_rank0.pt")
    if state.get("world_size") != D.world_size():
        # Per-rank pools and RNG streams cannot be split or merged exactly: go on from rank 0's bookkeeping, say so
        print(f"[warn] checkpoint was written by {state.get('world_size')} ranks, resuming on {D.world_size()}: "
              f"RNG streams and per-rank question pools are re-derived, so steps will not match a same-size resume")
    set_rng_state(state["rng"])
    return state
