"""The run folder's ownership: which run a launch continues, starts over or is refused, and whether every rank sees
the same folder.

Under <output_dir>/:
    config.json                 the run's resolved config; a later launch with run-defining
                                differences is refused unless --overwrite true (`claim_output_dir`)
    checkpoints/run_id          the id of the run that owns this folder; checkpoint rotation deletes only
                                folders carrying it (training/engine/checkpoint.py)
    .rank0_marker               a random token rank 0 writes at start-up: every rank must read it
                                back, or the launch is refused (`check_shared_output_dir`)

What the folder answers read-only (may a launch use it, which complete checkpoint it resumes from) is
training/engine/run_state.py's; this module writes the claim and deletes what a start-over replaces.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from training.settings.config import ConfigError
from training.engine.run_state import RUN_ID, STARTED_OVER, TAG_RE, ckpt_root, config_diff_all, output_dir_verdict, run_owner
from utils import dist as D


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def write_atomic(path: Path, text: str) -> None:
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
        write_atomic(root / RUN_ID, rid + "\n")
    return rid


def trash(path: Path) -> None:
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
    v = output_dir_verdict(out, config)  # training/engine/run_state.py: the same verdict --dry_run reads
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
                    trash(p)
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
    write_atomic(cfg_file, json.dumps(config, indent=2) + "\n")
    rid = prev or _new_run_id()
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / RUN_ID, rid + "\n")
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
    if D.world_size() == 1:
        return
    token = None
    if D.is_main():
        token = uuid.uuid4().hex
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(output_dir) / MARKER, token + "\n")
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
