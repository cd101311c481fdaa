"""Experiment trackers beyond TensorBoard (`--report_to wandb,mlflow`), behind utils.logging.RunLogger.

TensorBoard and metrics.jsonl stay in RunLogger; this module holds the trackers that may be down,
misconfigured or not installed. RunLogger opens them on rank 0 only, and each failure is caught
there: the tracker is named in one warning and switched off, and the run goes on with the others
and with metrics.jsonl, which is written before any tracker is called.

What each tracker gets:
  - config: the resolved config (`public_config`: fields named like a secret are dropped, a URL's
    user:password@ is masked; the judge's key is read from OPENAI_API_KEY and is never in it);
  - scalars: the namespaced names as they are, at the trainer's step, NaN and inf included, except
    that MLflow gets no +-inf: its SQL store writes them as +-1.8e308, a finite number a chart would
    show as real; each such value is left out of MLflow with one warning per metric name (metrics.jsonl
    and the other trackers keep it);
  - samples: wandb, a Table per tag that grows by a row per dump; MLflow, samples/step_N.txt as an
    artifact (the same text as the run folder's file);
  - resume: the tracker run ids are kept in <output_dir>/trackers.json, and a later RunLogger on the
    same folder continues those runs (wandb id + resume="allow"; the same MLflow run id).

Where they write, as the HF Trainer reads it from the environment: wandb, WANDB_PROJECT (default
"ssp"), WANDB_ENTITY, WANDB_MODE=offline (then `wandb sync <output_dir>/wandb/offline-run-*`), its
files under <output_dir>/wandb/; MLflow, MLFLOW_TRACKING_URI (default: a SQLite store in
<output_dir>/mlflow/, artifacts beside it) and MLFLOW_EXPERIMENT_NAME (default "ssp").
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

REPORT_TO = ("tensorboard", "wandb", "mlflow")
STATE = "trackers.json"   # in the run folder: {"wandb": run id, "mlflow": {"run_id", "tracking_uri"}}
INSTALL = "pip install -r requirements-trackers.txt"


def parse_report_to(spec: str | list | tuple) -> list[str]:
    """`--report_to` as a list of tracker names: a comma list of tensorboard, wandb, mlflow (HF's
    spelling), or "none". Raises ValueError naming what is not a tracker."""
    names = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in REPORT_TO]
    if bad:
        raise ValueError(f"--report_to takes a comma list of {', '.join(REPORT_TO)}, or none; got {', '.join(bad)}")
    return list(dict.fromkeys(names))


# A field named like one of these never goes to a tracker (word-bounded: max_tokens_per_turn is no token).
SECRET_NAME = re.compile(r"(^|_)(api_?key|secret|password|passwd|access_token|auth_token|credentials?)($|_)", re.I)
URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")


def masked(url: str) -> str:
    """url with its user:password@ masked."""
    return URL_USERINFO.sub(r"\1***@", url)


def public_config(config: dict) -> dict:
    """The run config as trackers receive it: fields named like a secret dropped, and the user:password@
    of a URL masked. The judge's API key never is a field (OPENAI_API_KEY only); this guards later ones."""
    out = {}
    for k, v in config.items():
        if SECRET_NAME.search(str(k)):
            continue
        if isinstance(v, dict):
            v = public_config(v)
        elif isinstance(v, str):
            v = masked(v)
        out[k] = v
    return out


def flat(d: dict, prefix: str = "") -> dict:
    """A nested dict as {"group.field": value} (tracker params here; config_diff in training/engine/run_state.py)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_state(out_dir: Path) -> dict:
    try:
        state = json.loads((Path(out_dir) / STATE).read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(out_dir: Path, state: dict) -> None:
    path = Path(out_dir) / STATE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


class Wandb:
    """A wandb run; its id is kept in trackers.json and continued with resume="allow"."""

    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, state: dict, run_name: str, job_type: str = "train"):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "ssp", entity=os.environ.get("WANDB_ENTITY"),
                              name=run_name, id=state.get("wandb"), resume="allow", dir=str(out_dir), config=config,
                              job_type=job_type, allow_val_change=True)  # a resume may change operational fields
        # The trainer's step is the x-axis, not wandb's own _step: a resumed run logs again the steps after
        # its last checkpoint, and wandb drops a log whose step= goes back (metrics.jsonl keeps both rows too).
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.tables: dict = {}
        state["wandb"] = self.run.id

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def text(self, step: int, tag: str, body: str, samples_file: Path) -> None:
        table = self.tables.get(tag)
        if table is None:
            table = self.tables[tag] = self.wandb.Table(columns=["step", "text"], log_mode="INCREMENTAL")
        table.add_data(step, body)
        self.run.log({tag: table, "step": step})

    def summary(self, values: dict, tables: dict[str, list[dict]]) -> None:
        for k, v in values.items():
            self.run.summary[k] = v
        for key, rows in tables.items():
            cols = list(dict.fromkeys(c for r in rows for c in r))
            self.run.log({key: self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])})

    def close(self) -> None:
        self.run.finish()


# MLflow's own rule for metric and param names (mlflow.utils.validation); others are refused per batch.
MLFLOW_NAME = re.compile(r"^[/\w.\- :]*$")
MLFLOW_PARAM_CHARS = 6000   # a param value's limit in MLflow 2.x (3.x: 8000)


class Mlflow:
    """An MLflow run through MlflowClient (no global active run); its id is kept in trackers.json."""

    name = "mlflow"

    def __init__(self, out_dir: Path, config: dict, state: dict, run_name: str, warn, job_type: str = "train"):
        from mlflow.tracking import MlflowClient

        self.warn, self._said = warn, set()
        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:  # the run folder holds its own store, as it holds tensorboard/
            local = (Path(out_dir) / "mlflow").resolve()
            local.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{local / 'mlflow.db'}", (local / "artifacts").as_uri()
        elif uri.startswith(("http://", "https://")):
            check_server(uri)
        self.client = MlflowClient(uri)
        shown_uri = masked(uri)
        prev = state.get("mlflow") if isinstance(state.get("mlflow"), dict) else {}
        run = None
        if prev.get("run_id") and prev.get("tracking_uri") != shown_uri:
            warn(f"mlflow: {STATE} names run {prev['run_id']} at {prev.get('tracking_uri')}, but the tracking URI is "
                 f"{shown_uri} now; this launch starts a new MLflow run there")
        elif prev.get("run_id"):
            try:
                run = self.client.get_run(prev["run_id"])
            except Exception as e:  # noqa: BLE001 - e.g. a store that was deleted: a new run, said once
                warn(f"mlflow: run {prev['run_id']} of {STATE} is not in {shown_uri} ({one_line(e)}); "
                     f"this launch starts a new MLflow run")
            else:
                self.client.update_run(run.info.run_id, status="RUNNING")
        if run is None:
            exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ssp"
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name, artifact_location=artifacts)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"ssp.output_dir": str(Path(out_dir).resolve()),
                                                                       "ssp.job_type": job_type})
        self.run_id = run.info.run_id
        state["mlflow"] = {"run_id": self.run_id, "tracking_uri": shown_uri}
        self._log_config(config, run.data.params)

    def _log_config(self, config: dict, logged: dict) -> None:
        """Params once (MLflow refuses to change a logged one: a resume keeps the first launch's values and
        says which differ); the whole config as config.json, replaced at every launch."""
        from mlflow.entities import Param

        params = {k: json.dumps(v) if isinstance(v, (list, dict)) or v is None else str(v) for k, v in flat(config).items()}
        params = {k: v[:MLFLOW_PARAM_CHARS] for k, v in params.items() if MLFLOW_NAME.match(k)}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            self.warn(f"mlflow: params keep their first values ({', '.join(changed)} changed on this launch); "
                      f"the current config is the run's config.json artifact")
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.client.log_text(self.run_id, json.dumps(config, indent=2) + "\n", "config.json")

    def _once(self, key: str, msg: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.warn(msg)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now, batch = int(time.time() * 1000), []
        for k, x in metrics.items():
            if not MLFLOW_NAME.match(k):
                self._once(k, f"mlflow: metric {k!r} has a character MLflow refuses in names; not sent to mlflow")
            elif math.isinf(x):
                self._once(k, f"mlflow: {k} = {x} not sent to mlflow (its store would keep +-1.8e308, a finite "
                              f"number); metrics.jsonl and the other trackers have it. Said once per metric")
            else:
                batch.append(Metric(k, x, now, step))
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def text(self, step: int, tag: str, body: str, samples_file: Path) -> None:
        self.client.log_artifact(self.run_id, str(samples_file), "samples")  # the whole step's file, replaced

    def summary(self, values: dict, tables: dict[str, list[dict]]) -> None:
        self.scalars(0, values)
        for key, rows in tables.items():
            self.client.log_text(self.run_id, json.dumps(rows, indent=2, default=str) + "\n", f"{key}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def check_server(uri: str, timeout_s: float = 5.0, tries: int = 2) -> None:
    """Raise ConnectionError unless the MLflow server at `uri` answers /health: a server that is down
    would otherwise hold the start-up for minutes in MLflow's own retries. Any HTTP answer counts
    as up (a proxy's 401 or 404 is for MLflow's client to report)."""
    import urllib.error
    import urllib.request

    for i in range(tries):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError) as e:
            if i + 1 == tries:
                raise ConnectionError(f"no MLflow server answers at {masked(uri)} ({e})") from None
            time.sleep(1.0)


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def open_tracker(name: str, out_dir: Path, config: dict, state: dict, run_name: str, warn, job_type: str = "train"):
    """The tracker, or None after one warning that says why it is not there."""
    try:
        if name == "wandb":
            return Wandb(out_dir, config, state, run_name, job_type)
        return Mlflow(out_dir, config, state, run_name, warn, job_type)
    except ImportError as e:
        warn(f"--report_to {name}: {name} is not installed ({one_line(e)}); `{INSTALL}`. The run goes on without it")
    except Exception as e:  # noqa: BLE001 - a tracker never stops a run
        warn(f"--report_to {name}: could not start {name} ({one_line(e)}). The run goes on without it")
    return None


def eval_summary(per_source: dict, overall: dict) -> tuple[dict, list[dict]]:
    """eval.py's per-source table as a tracker summary: the values {"eval/<source>/<metric>": x}, nested
    dicts as further parts (eval/nq/title_copy_at/1), the overall row as source "overall"; and the table,
    a row per source and one for overall, of the numbers (None where a metric has none)."""
    values, rows = {}, []
    for src, m in [*per_source.items(), ("overall", overall)]:
        row = {"data_source": src}
        for k, x in flat(m).items():
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                values[f"eval/{src}/{k.replace('.', '/')}"] = x
                row[k] = x
        rows.append(row)
    return values, rows

