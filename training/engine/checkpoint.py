"""Checkpoints that resume a crashed run exactly: save, rotate, load.

Layout under <output_dir>/checkpoints/ (the folder's ownership, config.json and run_id: training/engine/run_folder.py):
    step_000010/                DeepSpeed save_checkpoint tag (ZeRO shards, optimizer, scheduler)
        run_id                  written first: rotation deletes only folders carrying this run's id
        trainer_rank{r}.pt      per-rank client state: step, RNG states, data cursor, question pool,
                                EMA baselines, curriculum; plain types only, read with weights_only=True
        hf/                     HF export (training/engine/hf_export.py)
        critic/, critic_hf/     the PPO critic's DeepSpeed tag; its HF export with --export_critic
    latest                      the newest *complete* tag, written last and atomically

A run killed mid-save leaves `latest` on the previous complete checkpoint, so `--resume auto`
never loads a half-written one; the half-written folder carries this run's id and is replaced
when the resumed run saves that step again. What the folder answers read-only (which complete checkpoint
a launch resumes from, the newest complete one when `latest` is damaged) is training/engine/run_state.py's;
this module writes, rotates and deletes checkpoints.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import threading
from collections import deque
from pathlib import Path

import numpy as np
import torch

from training.engine.hf_export import export_hf
from training.engine.run_folder import run_id, trash, write_atomic
from training.engine.run_state import RUN_ID, TAG_RE, ResumeError, ckpt_root, resume_offer, run_owner, tag_for
from utils import dist as D


def fault_point(where: str, step: int) -> None:
    """Crash injection for the tests: SSP_FAULT=in_save:2 kills the process (no clean-up, like a
    node failure) in the middle of writing checkpoint 2 (same variable as the trainer's points)."""
    if os.environ.get("SSP_FAULT", "") == f"{where}:{step}":
        print(f"SSP_FAULT: killing rank {D.rank()} at {where} of step {step}", flush=True)
        os._exit(17)


def kill_in_round(step: int) -> None:
    """Crash injection for bench/bench_faults.py: SSP_FAULT=kill_in_round:2:5 kills the process 5 s into step 2's
    round (a timer, so wherever the round then is: mid-decode, mid-search), like a node failure."""
    kind, _, rest = os.environ.get("SSP_FAULT", "").partition(":")
    at, _, after_s = rest.partition(":")
    if kind != "kill_in_round" or not at.isdigit() or int(at) != step:
        return

    def die() -> None:
        print(f"SSP_FAULT: killing rank {D.rank()} {after_s} s into step {step}'s round", flush=True)
        os._exit(17)
    timer = threading.Timer(float(after_s), die)
    timer.daemon = True
    timer.start()


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


# ----------------------------------------------------------------------------- save / resume

def _make_room(path: Path, rid: str, latest: str | None) -> None:
    """Before writing checkpoint `path`: a folder of this run under that name is a half-written
    one from a killed save (it cannot be `latest`), so it goes; a folder of another run or of
    none (copied in by hand) is moved aside, never written into or deleted."""
    if not path.exists() or path.name == latest:
        return
    if run_owner(path) == rid:
        trash(path)
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
        write_atomic(root / "latest", tag + "\n")  # the commit point
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
            trash(p)


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
