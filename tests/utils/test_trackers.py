"""utils/trackers.py through RunLogger (`--report_to`): each tracker run for real, offline, and read back.

wandb runs with WANDB_MODE=offline; its run file (run-<id>.wandb, a LevelDB-style log of protobuf
records) is read back with wandb's own protobuf classes. MLflow writes to SQLite stores and is read
back through MlflowClient. No mocks: the failures are real ones (a wandb server that is not there,
an MLflow URI of no known scheme, a store whose metrics table is dropped under a running logger).
The heavy imports and one SQLite schema are paid once per module (`trackers`).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import struct
import time
from pathlib import Path

import pytest

from utils.logging import RunLogger, read_metrics

wandb = pytest.importorskip("wandb", reason="pip install -r requirements-trackers.txt")
mlflow = pytest.importorskip("mlflow", reason="pip install -r requirements-trackers.txt")

SECRET = "sk-test-tracker-must-never-see-this"
URL_PASSWORD = "pw-in-a-url-0123"


@pytest.fixture(scope="module")
def trackers(tmp_path_factory):
    """wandb offline with its caches in a temporary folder; a shared SQLite MLflow store (its schema
    migration takes seconds) with an experiment whose artifacts stay there too."""
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", **{
        k: str(d / "wandb_home") for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")},
        "MLFLOW_TRACKING_URI": f"sqlite:///{d / 'mlflow.db'}", "MLFLOW_EXPERIMENT_NAME": "ssp-tests"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        wandb.teardown()   # wandb reads its environment once per process, at its first run (or after a teardown)
        MlflowClient().create_experiment("ssp-tests", artifact_location=(d / "artifacts").as_uri())
        yield d
        wandb.teardown()


def _config(monkeypatch) -> dict:
    """A real resolved config whose judge has a key (from the environment, as always) and a URL with a password."""
    from training.settings.config import parse_config

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    return parse_config(["--judge", "llm", "--judge_url", f"http://judge:{URL_PASSWORD}@127.0.0.1:1/v1",
                         "--retriever_url", "http://127.0.0.1:2"]).to_dict()


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline run file: 7-byte header, then 32 KiB blocks of chunks, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:  # zero padding to the end of a block
            pos += left - 7
            continue
        buf += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _finished_records(run_file: Path, wait_s: float = 60.0) -> list:
    """The records of a finished run: wandb's service may still be writing the file when finish() returns."""
    deadline = time.time() + wait_s
    while True:
        records = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            return records
        time.sleep(0.2)


def _wandb_run(out: Path) -> tuple[dict, list[dict]]:
    """(config, history rows) of every offline run file under out/wandb, in the order they were written."""
    config, rows = {}, []
    for f in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for r in _finished_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return config, rows


def _files_hold(root: Path, *needles: str) -> list[str]:
    return [f"{p}: {n}" for p in root.rglob("*") if p.is_file() for n in needles if n.encode() in p.read_bytes()]


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("[warn]")]


@pytest.mark.timeout(120)
def test_report_to_names_and_the_secret_free_config(monkeypatch):
    from training.settings.config import ConfigError, parse_config
    from utils.trackers import parse_report_to, public_config

    assert parse_report_to("tensorboard") == ["tensorboard"]
    assert parse_report_to(" wandb, MLflow ,wandb") == ["wandb", "mlflow"] and parse_report_to("none") == []
    with pytest.raises(ConfigError, match="--report_to takes a comma list of tensorboard, wandb, mlflow, or none; got comet"):
        parse_config(["--report_to", "wandb,comet"])
    cfg = public_config({**_config(monkeypatch), "extra": {"api_key": SECRET, "judge_api_key": SECRET,
                                                           "max_tokens_per_turn": 7}})
    text = json.dumps(cfg)
    assert SECRET not in text and URL_PASSWORD not in text and "api_key" not in text
    assert cfg["selfplay"]["judge_url"] == "http://***@127.0.0.1:1/v1" and cfg["extra"]["max_tokens_per_turn"] == 7


@pytest.mark.timeout(120)
def test_wandb_offline_run_holds_config_scalars_samples(trackers, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    config = _config(monkeypatch)
    log = RunLogger(out, enabled=True, report_to="tensorboard,wandb", config=config)
    assert [t.name for t in log.trackers] == ["wandb"]
    log.scalars(1, {"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "x/neg": float("-inf"),
                    "solver/acc": 0.25})
    log.text(2, "samples/solver", "reward=1.000 answer='Paris'\n<search>capital of France</search>")
    log.scalars(2, {"actor/pg_loss": 0.5, "solver/acc": 0.5})
    log.close()

    cfg, rows = _wandb_run(out)
    assert cfg["optimisation"]["lr"] == config["optimisation"]["lr"] and cfg["selfplay"]["judge"] == "llm"
    assert cfg["selfplay"]["judge_url"] == "http://***@127.0.0.1:1/v1"
    scalars = [r for r in rows if "solver/acc" in r]
    assert [r["step"] for r in scalars] == [1, 2]      # the trainer's step, the x-axis of every metric
    first = scalars[0]
    assert math.isnan(first["actor/pg_loss"]) and first["actor/grad_norm"] == math.inf and first["x/neg"] == -math.inf
    assert scalars[1]["actor/pg_loss"] == 0.5
    (table,) = out.glob("wandb/offline-run-*/files/media/table/samples/solver_*.table.json")
    assert json.loads(table.read_text()) == {"columns": ["step", "text"], "data": [
        [2, "reward=1.000 answer='Paris'\n<search>capital of France</search>"]]}
    assert [r["step"] for r in rows if r.get("samples/solver/_type") == "incremental-table-file"] == [2]
    assert not _files_hold(out, SECRET, URL_PASSWORD), "a secret reached wandb's files"
    # metrics.jsonl and TensorBoard as ever
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2] and any((out / "tensorboard").iterdir())
    (run_dir,) = out.glob("wandb/offline-run-*")
    assert run_dir.name.endswith("-" + json.loads((out / "trackers.json").read_text())["wandb"])
    assert not _warnings(capsys.readouterr().err)


@pytest.mark.timeout(120)
def test_mlflow_run_holds_config_scalars_samples_and_leaves_inf_out_once(trackers, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    config = _config(monkeypatch)
    log = RunLogger(out, enabled=True, report_to="mlflow", config=config)
    log.scalars(1, {"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "solver/acc": 0.25})
    log.text(1, "samples/proposer", "question: who wrote Hamlet?")
    log.text(1, "samples/solver", "answer: Shakespeare")
    log.scalars(2, {"actor/pg_loss": 0.5, "actor/grad_norm": float("inf"), "solver/acc": 0.5})
    log.close()

    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    c = MlflowClient()
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["optimisation.lr"] == str(config["optimisation"]["lr"])
    assert run.data.params["selfplay.judge_url"] == "http://***@127.0.0.1:1/v1"
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "solver/acc")] == [(1, 0.25), (2, 0.5)]
    pg = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "actor/pg_loss"))
    assert pg[0][0] == 1 and math.isnan(pg[0][1]) and pg[1] == (2, 0.5)
    assert c.get_metric_history(run_id, "actor/grad_norm") == []   # +-inf is not sent (the store would clamp it)
    err = _warnings(capsys.readouterr().err)
    assert len(err) == 1 and "actor/grad_norm = inf not sent to mlflow" in err[0], err
    local = Path(c.download_artifacts(run_id, "", str(tmp_path / "back")))
    assert (local / "samples" / "step_000001.txt").read_text() == (out / "samples" / "step_000001.txt").read_text()
    assert "who wrote Hamlet?" in (local / "samples" / "step_000001.txt").read_text()
    assert json.loads((local / "config.json").read_text())["optimisation"]["lr"] == config["optimisation"]["lr"]
    stored = json.dumps({"params": run.data.params, "tags": run.data.tags}) + "".join(
        p.read_text() for p in local.rglob("*") if p.is_file())
    assert SECRET not in stored and URL_PASSWORD not in stored
    assert not _files_hold(trackers, SECRET, URL_PASSWORD), "a secret reached the MLflow store"


@pytest.mark.timeout(300)   # ~20 s on an idle machine, most of it the new SQLite store's schema migration
def test_a_resumed_run_continues_the_same_tracker_runs(trackers, tmp_path, monkeypatch):
    """Two RunLogger lifetimes on one run folder (a run and its resume from a checkpoint at step 2): one wandb
    run id, one MLflow run. MLflow here is the default, the run folder's own SQLite store."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    out = tmp_path / "run"
    config = _config(monkeypatch)
    for steps in ([1, 2, 3], [3, 4]):   # the first launch died after logging step 3, the last checkpoint was step 2
        log = RunLogger(out, enabled=True, report_to="wandb,mlflow", config=config)
        assert [t.name for t in log.trackers] == ["wandb", "mlflow"]
        for s in steps:
            log.scalars(s, {"solver/acc": s / 10})
        log.close()
        time.sleep(1.1)   # wandb names an offline run's folder by the second it started
    state = json.loads((out / "trackers.json").read_text())
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and {f.name for f in files} == {f"run-{state['wandb']}.wandb"}
    for f in files:
        (run,) = [r.run for r in _finished_records(f) if r.WhichOneof("record_type") == "run"]
        assert run.run_id == state["wandb"]
    _, rows = _wandb_run(out)
    assert [r["step"] for r in rows if "solver/acc" in r] == [1, 2, 3, 3, 4]   # as metrics.jsonl holds them
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 3, 4]

    assert state["mlflow"]["tracking_uri"] == f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}"
    c = MlflowClient(state["mlflow"]["tracking_uri"])
    (run,) = c.search_runs([c.get_experiment_by_name("ssp").experiment_id])
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "solver/acc")) == [1, 2, 3, 3, 4]
    assert (out / "mlflow" / "artifacts").is_dir()   # artifacts stay in the run folder too


@pytest.mark.timeout(180)
def test_trackers_that_are_down_or_misconfigured_warn_once_and_the_run_goes_on(trackers, tmp_path, monkeypatch, capsys,
                                                                             request):
    """wandb online against a server that is not there (its init times out); MLflow first at a server that is
    not there (the health probe), then at a URI of no known scheme. Each: one warning, and metrics.jsonl and
    TensorBoard hold every step."""
    from utils.dist import free_port

    port = free_port()
    wandb.teardown()   # so that wandb reads the environment below (and, after the test, the module's again)
    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "4")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    out = tmp_path / "run"
    log = RunLogger(out, enabled=True, report_to="tensorboard,wandb,mlflow", config={"a": 1})
    assert log.trackers == []
    for s in (1, 2):
        log.scalars(s, {"solver/acc": s / 10})
    log.text(2, "samples/solver", "still written")
    log.close()
    err = _warnings(capsys.readouterr().err)
    assert len(err) == 2, err
    assert err[0].startswith("[warn] --report_to wandb: could not start wandb") and "run goes on without it" in err[0]
    assert err[1].startswith("[warn] --report_to mlflow: could not start mlflow") and "no MLflow server answers" in err[1]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2] and any((out / "tensorboard").iterdir())
    assert "still written" in (out / "samples" / "step_000002.txt").read_text()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracker")
    log = RunLogger(out, enabled=True, report_to="mlflow", config={"a": 1})
    log.scalars(3, {"solver/acc": 0.3})
    log.close()
    (err,) = _warnings(capsys.readouterr().err)
    assert "could not start mlflow" in err and "nosuchscheme://tracker" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_a_tracker_that_fails_mid_run_is_switched_off_with_one_warning(trackers, tmp_path, capsys):
    """The MLflow store loses its metrics table under a running logger (a real sqlite error on the next
    write): one warning, MLflow is off from then on, wandb and metrics.jsonl keep every step."""
    out = tmp_path / "run"
    log = RunLogger(out, enabled=True, report_to="wandb,mlflow", config={"a": 1})
    log.scalars(1, {"solver/acc": 0.1})
    db = sqlite3.connect(str(trackers / "mlflow.db"))
    db.execute("ALTER TABLE metrics RENAME TO metrics_gone")
    db.commit()
    try:
        for s in (2, 3):
            log.scalars(s, {"solver/acc": s / 10})
    finally:
        db.execute("ALTER TABLE metrics_gone RENAME TO metrics")
        db.commit()
        db.close()
    log.close()
    (err,) = _warnings(capsys.readouterr().err)
    assert err.startswith("[warn] mlflow: scalars failed") and "switched off for the rest of this run" in err
    assert [t.name for t in log.trackers] == []
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    _, rows = _wandb_run(out)
    assert [r["step"] for r in rows if "solver/acc" in r] == [1, 2, 3]


def test_other_ranks_open_no_tracker(tmp_path):
    log = RunLogger(tmp_path / "rank1", enabled=False, report_to="wandb,mlflow", config={"a": 1})
    log.scalars(1, {"solver/acc": 0.5})
    log.text(1, "samples/solver", "x")
    log.close()
    assert log.trackers == [] and not (tmp_path / "rank1").exists()


@pytest.mark.timeout(600)   # the first user of the session's tiny model builds it (minutes on a busy machine)
def test_eval_logs_its_per_source_table_as_a_summary(trackers, tiny_model_dir, tmp_path, capsys):
    """eval.py --report_to wandb,mlflow: one tracker run each, holding every per-source number as a summary and
    the table itself (a wandb Table; a JSON artifact in MLflow), with the same numbers as results.json."""
    import eval as eval_cli
    from mlflow.tracking import MlflowClient

    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--model", "m", "--data", "d.jsonl", "--out_dir", str(tmp_path), "--report_to", "comet"])
    assert "--report_to takes a comma list" in capsys.readouterr().err
    out = tmp_path / "ev"
    assert eval_cli.main(["--model", str(tiny_model_dir), "--engine", "hf", "--data", "data/eval/capitals.jsonl",
                          "--limit", "2", "--max_turns", "1", "--max_tokens_per_turn", "8", "--out_dir", str(out),
                          "--report_to", "wandb,mlflow"]) == 0
    res = json.loads((out / "results.json").read_text())
    want = {"eval/capitals/em": res["per_source"]["capitals"]["em"], "eval/overall/n": 2,
            "eval/capitals/title_copy_at/1": res["per_source"]["capitals"]["title_copy_at"]["1"]}
    assert not _warnings(capsys.readouterr().err)

    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    summary = {}
    for r in _finished_records(run_file):
        if r.WhichOneof("record_type") == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
    assert {k: summary[k] for k in want} == want
    (table,) = out.glob("wandb/offline-run-*/files/media/table/eval/per_source_*.table.json")
    t = json.loads(table.read_text())
    assert [row[t["columns"].index("data_source")] for row in t["data"]] == ["capitals", "overall"]

    c = MlflowClient()
    run = c.get_run(json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"])
    assert {k: run.data.metrics[k] for k in want} == want and run.data.tags["ssp.job_type"] == "eval"
    local = Path(c.download_artifacts(run.info.run_id, "eval/per_source.json", str(tmp_path / "back")))
    assert [r["data_source"] for r in json.loads(local.read_text())] == ["capitals", "overall"]
