"""What a run folder holds, read without changing anything: whether a launch may use it, and the checkpoint
it resumes from. No torch: train.py's --dry_run and the trainer (before any model is built) ask the same
questions, and training/engine/run_folder.py and training/engine/checkpoint.py act on the answers (they write, rotate and delete).

A checkpoint folder is complete when it holds the trainer's state (trainer_rank*.pt) and DeepSpeed's model
states, and every .pt file in it is whole (torch.save writes zips: a truncated one has lost its directory,
which sits at the end). `checkpoints/latest` is written last, so it names a complete checkpoint unless the
folder was damaged afterwards; then the resume error names the newest complete one instead.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from training.settings.config import Config, upgrade_saved_config
from utils.errors import InputError
from utils.trackers import flat as _flat  # nested config dict -> {"group.field": value}

TAG_RE = re.compile(r"^step_(\d+)$")
RUN_ID = "run_id"

# Config fields that may change between launches of one run: they change how a run is watched,
# saved, placed in memory or reached over the network, never what it trains. Everything else
# (model, data, search backends, algorithm, optimizer, seed, vLLM TP and its data split) defines
# the run, and a different value in an existing output_dir is refused without --overwrite.
OPERATIONAL = frozenset({
    "logging.output_dir", "logging.log_every", "logging.sample_every", "logging.tensorboard", "logging.report_to",
    "logging.dump_rollouts",
    "optimisation.total_steps",       # extending a run; cosine/linear LR and the simulated-search noise
                                      # curriculum stretch to the new total from the resumed step on
    "optimisation.micro_token_budget",  # packing only: the loss normaliser is global
    "optimisation.max_failed_share", "optimisation.failed_share_window", "optimisation.max_nonfinite_steps",  # guards
    "model.gradient_checkpointing",   # recompute, same math
    "deepspeed.gpu_memory_gb", "deepspeed.retriever_gpu_gb",  # only the dry run's memory plan reads them
    "selfplay.allow_demo_defaults",   # a start-up check; the paths themselves are run-defining
    "checkpointing.save_every", "checkpointing.max_ckpts", "checkpointing.resume", "checkpointing.export_hf",
    "checkpointing.overwrite",
    "critic.export_critic", "critic.critic_offload_param", "critic.critic_gradient_checkpointing",
    "eval.eval_every", "eval.eval_data", "eval.eval_limit",  # evaluation reads the weights, never trains them
    "deepspeed.local_rank", "deepspeed.offload_param", "deepspeed.ref_offload",
    "rollout.gpu_memory_utilization", "rollout.kv_cache_mb", "rollout.sync_bucket_mb",
    "search.retriever_url", "search.sim_url", "selfplay.judge_url",  # services move between restarts
})
STARTED_OVER = ("metrics.jsonl", "samples", "rollouts", "tensorboard", "trackers.json")  # deleted by --overwrite (trackers: new runs)
DELETES = "this run's checkpoints, metrics.jsonl, samples/, rollouts/, tensorboard/ and trackers.json"


class ResumeError(InputError):
    """The checkpoint to resume from is missing or damaged; the message names the newest complete one."""


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def ckpt_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def run_owner(path: Path) -> str | None:
    try:
        return (path / RUN_ID).read_text().strip() or None
    except OSError:
        return None


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
    """{"group.field": (old, new)} for every run-defining field whose value differs. A field the
    old config.json lacks (written before the field existed) counts as its default; one written under the group
    it used to belong to (--distill* under "algorithm") is read where it belongs now (upgrade_saved_config)."""
    new = _flat(json.loads(json.dumps(new)))
    old = {**_flat(json.loads(json.dumps(Config().to_dict()))), **_flat(upgrade_saved_config(old))}
    return {k: (old.get(k), v) for k, v in new.items() if k not in OPERATIONAL and old.get(k) != v}


def config_diff_all(old: dict, new: dict) -> dict[str, tuple]:
    """Like config_diff, but over every field (operational ones too), ignoring local_rank."""
    new, old = _flat(json.loads(json.dumps(new))), _flat(upgrade_saved_config(old))
    return {k: (old.get(k), v) for k, v in new.items() if k in old and old[k] != v and k != "deepspeed.local_rank"}


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_problems(path: Path) -> list[str]:
    """[] for a complete checkpoint folder; else what is missing or damaged in it, file by file."""
    if not path.is_dir():
        return [f"{path} is missing"]
    probs = []
    if not any(path.glob("trainer_rank*.pt")):
        probs.append("it has no trainer_rank0.pt (the trainer's state: step, data cursor, RNG, question pool)")
    if not any(path.glob("*model_states.pt")):
        probs.append("it has no DeepSpeed model states (*model_states.pt)")
    for f in sorted(p for p in path.rglob("*.pt") if p.relative_to(path).parts[0] not in ("hf", "critic_hf")):
        if not zipfile.is_zipfile(f):  # torch.save writes a zip whose directory is at its end
            probs.append(f"{f.relative_to(path)} is truncated or damaged ({f.stat().st_size} bytes, not a whole "
                         f"torch file)")
    return probs


def newest_complete(root: Path, skip: tuple[str, ...] = ()) -> Path | None:
    """The complete checkpoint with the highest step under `root` (checkpoints/), leaving out the names in `skip`."""
    if not root.is_dir():
        return None
    tags = sorted(((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := TAG_RE.match(p.name)) and p.name not in skip), reverse=True)
    return next((p for _, p in tags if not checkpoint_problems(p)), None)


def resume_offer(root: Path, skip: tuple[str, ...] = ()) -> str:
    """The ways on from a damaged checkpoint: the newest complete one by name, else starting over (what it deletes)."""
    good = newest_complete(root, skip)
    over = (f"start over with --resume none --overwrite true (it deletes {DELETES} under {root.parent}), or "
            f"pick another --output_dir")
    if good is not None:
        return f"The newest complete checkpoint is {good.name}: pass --resume {good} to continue from it; or {over}"
    return f"No complete checkpoint is left in {root}: {over}"


def damaged_latest(output_dir: str | Path) -> str | None:
    """What is wrong with checkpoints/latest (None when it names a complete checkpoint, or there is none)."""
    marker = ckpt_root(output_dir) / "latest"
    if not marker.exists():
        return None
    try:
        name = marker.read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if not TAG_RE.match(name):
        return f"{marker} is damaged (it holds {name[:40]!r}, not a checkpoint name like {tag_for(10)})"
    path = marker.parent / name
    if not path.is_dir():
        return f"{marker} names {name}, which is missing"
    probs = checkpoint_problems(path)
    return f"{marker} names {name}, which is incomplete: " + "; ".join(probs) if probs else None


def find_resume(output_dir: str | Path, resume: str) -> Path | None:
    """`auto`: the latest complete checkpoint under output_dir, or None. `none`: None.
    Anything else: that checkpoint folder, which must exist and be complete. ResumeError otherwise,
    naming the newest complete checkpoint to pass instead."""
    root = ckpt_root(output_dir)
    if resume == "none":
        return None
    if resume == "auto":
        if not (root / "latest").exists():
            return None
        bad = damaged_latest(output_dir)
        if bad:
            name = (root / "latest").read_text(errors="replace").strip()
            raise ResumeError(f"cannot resume (--resume auto): {bad}. {resume_offer(root, skip=(name,))}")
        return root / (root / "latest").read_text().strip()
    path = Path(resume)
    if not path.is_dir() or not TAG_RE.match(path.name):
        raise ResumeError(f"--resume {resume}: expected a checkpoint folder like {root / tag_for(10)}"
                          + (f". {resume_offer(root)}" if root.is_dir() else ""))
    probs = checkpoint_problems(path)
    if probs:
        raise ResumeError(f"--resume {resume}: the checkpoint is damaged: {'; '.join(probs)}. "
                          f"{resume_offer(path.parent, skip=(path.name,))}")
    return path


# ----------------------------------------------------------------------------- the run folder

@dataclass
class OutputDirVerdict:
    """What a launch with `config` would do to output_dir (training/engine/run_folder.py's claim_output_dir acts on it)."""
    old: dict | None = None                    # the folder's config.json, when it reads as one
    diffs: dict = field(default_factory=dict)  # run-defining fields that differ
    has_ckpt: bool = False                     # checkpoints/latest exists
    refusal: str | None = None                 # why the launch is refused (None: it may go on)
    starts_over: bool = False                  # --overwrite true deletes this run's checkpoints and logs


def output_dir_verdict(output_dir: str | Path, config: dict, ignore: tuple[str, ...] = ()) -> OutputDirVerdict:
    """Whether a launch with the resolved `config` (Config.to_dict()) may use output_dir; `ignore`: fields left
    out of the comparison (the dry run's --prompts_per_step 0, which the launch resolves against the run)."""
    resume, overwrite = config["checkpointing"]["resume"], bool(config["checkpointing"].get("overwrite"))
    out, root = Path(output_dir), ckpt_root(output_dir)
    cfg_file = out / "config.json"
    v = OutputDirVerdict(has_ckpt=(root / "latest").exists())
    what = ""
    if cfg_file.exists():
        try:
            v.old = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            v.old = None
        if isinstance(v.old, dict):
            v.diffs = {k: d for k, d in config_diff(v.old, config).items() if k not in ignore}
            what = "these run-defining fields differ:\n" + "\n".join(
                f"    {k}: {o!r} (in {cfg_file}) -> {n!r} (now)" for k, (o, n) in sorted(v.diffs.items()))
        else:
            v.old, v.diffs, what = None, {"config.json": None}, f"its {cfg_file} is unreadable, so it cannot be compared"
    elif v.has_ckpt:
        v.diffs, what = {"config.json": None}, "it holds checkpoints but no config.json, so their run is unknown"
    if v.diffs and not overwrite:
        v.refusal = (
            f"--output_dir {out} holds another run: {what}\n"
            f"  Resuming it with these settings would mix two runs. Pass --overwrite true to start over in this "
            f"folder (it deletes {DELETES.replace('this run', 'that run')}), or pick another "
            f"--output_dir. Fields that may change on resume: {', '.join(sorted(OPERATIONAL))}")
    elif resume == "none" and v.has_ckpt and not v.diffs and not overwrite:
        bad = damaged_latest(out)
        latest = (root / "latest").read_text(errors="replace").strip()
        good = newest_complete(root) if bad else root / latest
        cont = (f"--resume auto to continue from {latest}, " if not bad else "")
        cont += f"--resume {good} to continue from that checkpoint, " if good is not None else ""
        v.refusal = (f"--resume none would start over in {out}, on top of its checkpoints ("
                     + (bad if bad else f"{latest} is the latest") + f"). Pass {cont}--overwrite true to start over "
                     f"here (it deletes {DELETES}), or pick another --output_dir")
    v.starts_over = overwrite and (bool(v.diffs) or (resume == "none" and v.has_ckpt))
    return v


def run_folder_errors(output_dir: str | Path, config: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """Everything a launch would refuse about output_dir, read-only: another run's folder, --resume none on top
    of checkpoints, a damaged checkpoint to resume from. [] when the launch may go on."""
    v = output_dir_verdict(output_dir, config, ignore)
    if v.refusal:
        return [v.refusal]
    resume = config["checkpointing"]["resume"]
    if v.starts_over and resume in ("auto", "none"):
        return []  # --overwrite deletes this run's checkpoints first: nothing is resumed
    try:
        find_resume(output_dir, resume)
    except ResumeError as e:
        return [str(e)]
    return []
