"""Run logging: rank-0 printing, namespaced TensorBoard scalars, a JSONL metrics file, sample dumps.

Metric names are namespaced (`proposer/reward_mean`, `timing_s/generate`, ...),
and every scalar is appended to metrics.jsonl first, then sent to the trackers of
`--report_to` (TensorBoard; wandb and MLflow through utils/trackers.py), so a run
can be compared or plotted without any of them, and a tracker that fails loses nothing.

Non-finite values are logged, never dropped: a NaN loss is the first thing to see.
TensorBoard takes them as they are. Strict JSON has no NaN or infinity, so metrics.jsonl
holds the strings "nan", "inf" and "-inf" there; `float(v)` reads every value back, and
`read_metrics` returns the rows with those strings turned into floats again.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import time
from pathlib import Path

from utils import trackers as T
from utils.dist import is_main


NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


PROJECT_LOGGERS = ("inference", "training", "retrieval", "utils", "dataprep", "eval")


def configure_logging(rank: int = 0, stream=None) -> None:
    """Once per process, at start-up (train.py): the project's library loggers (judge, game, retrieval, ...)
    print with the rank in every line, info and up on rank 0 and warnings and up elsewhere. Other libraries
    stay at warnings (httpx logs every request at info); those with handlers of their own (vLLM) keep them.
    Calling it again replaces its handler rather than adding a second one."""
    import logging

    def keep(record: logging.LogRecord) -> bool:   # other libraries may set INFO on their own loggers (bm25s)
        own = record.name.split(".")[0] in PROJECT_LOGGERS
        return own or record.levelno >= logging.WARNING

    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name("ssp")
    handler.addFilter(keep)
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "ssp"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 else logging.WARNING)


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def as_scalar(v) -> float | None:
    """A metric value as a float (NaN and inf included); None for what is not a number."""
    if hasattr(v, "item") and not isinstance(v, numbers.Real):  # numpy / torch scalars (0-d tensors)
        try:
            v = v.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    return float(v) if isinstance(v, numbers.Real) else None


def json_scalar(x: float) -> float | str:
    """x, or "nan" / "inf" / "-inf" where strict JSON has no number for it."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def write_jsonl_atomic(path: str | Path, rows: list[dict]) -> None:
    """rows as JSON lines at path, written whole or not at all (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl, with the "nan" / "inf" / "-inf" strings back as floats."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
    return rows


class RunLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing (and never open a tracker).

    report_to: `--report_to`, a comma list of tensorboard, wandb, mlflow (or "none"); tensorboard=False
    leaves TensorBoard out whatever it says (`--tensorboard false`). config: the resolved config, each
    tracker's run config (secrets removed, utils.trackers.public_config). A wandb or MLflow tracker that
    cannot start, or fails later, gets one warning and is switched off; metrics.jsonl, TensorBoard and
    the other trackers go on."""

    def __init__(self, out_dir: str | Path, enabled: bool | None = None, tensorboard: bool = True,
                 report_to: str = "tensorboard", config: dict | None = None, run_name: str | None = None,
                 job_type: str = "train"):
        self.enabled = is_main() if enabled is None else enabled
        self.out_dir = Path(out_dir)
        self.tb = None
        self.trackers: list = []
        self._skipped: set[str] = set()
        names = T.parse_report_to(report_to)
        if not self.enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (self.out_dir / "metrics.jsonl").open("a")
        if tensorboard and "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        others = [n for n in names if n != "tensorboard"]
        if others:
            state = T.read_state(self.out_dir)
            cfg = T.public_config(config or {})
            name = run_name or self.out_dir.resolve().name
            self.trackers = [t for n in others
                             if (t := T.open_tracker(n, self.out_dir, cfg, state, name, warn, job_type)) is not None]
            if self.trackers:
                T.write_state(self.out_dir, state)

    def _to_trackers(self, method: str, *args) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                self.trackers.remove(t)
                # not closed either: closing a run on a server that is down would wait out its retries again
                warn(f"{t.name}: {method} failed ({T.one_line(e)}); {t.name} is switched off "
                     f"for the rest of this run, which goes on (metrics.jsonl and the other trackers keep logging)")

    def scalars(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {}
        for k, v in metrics.items():
            x = as_scalar(v)
            if x is None:
                if k not in self._skipped:  # a string or a list is not a scalar; said once per name
                    self._skipped.add(k)
                    warn(f"metric {k!r} is not a number ({type(v).__name__}); not logged")
                continue
            clean[k] = x
        row = {"step": step, "time": time.time(), **{k: json_scalar(x) for k, x in clean.items()}}
        self._metrics.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics.flush()
        if self.tb is not None:
            for k, x in clean.items():
                self.tb.add_scalar(k, x, step)
            self.tb.flush()
        self._to_trackers("scalars", step, clean)

    def text(self, step: int, tag: str, body: str) -> None:
        """Sample trajectories: to samples/step_N.txt, TensorBoard's text tab, a wandb Table, an MLflow artifact."""
        if not self.enabled:
            return
        d = self.out_dir / "samples"
        d.mkdir(exist_ok=True)
        path = d / f"step_{step:06d}.txt"
        with path.open("a") as f:
            f.write(f"===== {tag} =====\n{body}\n\n")
        if self.tb is not None:
            self.tb.add_text(tag, "```\n" + body + "\n```", step)
        self._to_trackers("text", step, tag, body, path)

    def close(self) -> None:
        if self.enabled:
            if self.tb is not None:
                self.tb.close()
            self._metrics.close()
            self._to_trackers("close")
            self.trackers = []


def fmt_metrics(metrics: dict, keys: list[str]) -> str:
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            parts.append(f"{k.split('/')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('/')[-1]}={v}")
    return " ".join(parts)


def warn(msg: str) -> None:
    print(f"[warn] {msg}", file=sys.stderr, flush=True)


def log_summary(report_to: str, out_dir: Path, config: dict, values: dict, tables: dict[str, list[dict]],
                run_name: str, warn=warn) -> None:
    """A tracker run per call, holding `config`, `values` as its summary and `tables` (eval.py: one eval,
    one run, its ids in out_dir/trackers.json). tensorboard in report_to writes nothing here. Failures:
    one warning each; the caller's own files are the record."""
    state: dict = {}
    for name in [n for n in T.parse_report_to(report_to) if n != "tensorboard"]:
        t = T.open_tracker(name, Path(out_dir), T.public_config(config), state, run_name, warn, job_type="eval")
        if t is None:
            continue
        try:
            t.summary(values, tables)
            t.close()
        except Exception as e:  # noqa: BLE001 - a tracker never fails the eval
            warn(f"{name}: the summary was not logged ({T.one_line(e)}); {out_dir} holds it")
    if state:
        T.write_state(Path(out_dir), state)
