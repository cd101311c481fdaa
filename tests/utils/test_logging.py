"""utils/logging.py: non-finite metrics are logged (TensorBoard and strict-JSON metrics.jsonl), never dropped."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from utils.logging import RunLogger, read_metrics


def _strict(line: str) -> dict:
    def refuse(const):
        raise ValueError(f"non-standard JSON constant {const}")
    return json.loads(line, parse_constant=refuse)


def test_nonfinite_metrics_reach_jsonl_as_strings_and_read_back(tmp_path, capsys):
    log = RunLogger(tmp_path, enabled=True, tensorboard=False)
    log.scalars(3, {"loss/policy": float("nan"), "grad/norm": float("inf"), "x/neg": float("-inf"),
                    "solver/acc": 0.5, "game/groups": 7, "np/f32": np.float32(2.5), "torch/t": torch.tensor(1.25),
                    "flag": True, "note": "text"})
    log.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = _strict(line)  # strict JSON: no NaN / Infinity tokens
    assert row["loss/policy"] == "nan" and row["grad/norm"] == "inf" and row["x/neg"] == "-inf"
    assert row["solver/acc"] == 0.5 and row["game/groups"] == 7 and row["np/f32"] == 2.5 and row["torch/t"] == 1.25
    assert row["flag"] == 1.0 and "note" not in row and row["step"] == 3
    assert all(math.isfinite(float(v)) or isinstance(v, str) for k, v in row.items() if k != "time")
    (back,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back["loss/policy"]) and back["grad/norm"] == math.inf and back["x/neg"] == -math.inf
    assert back["solver/acc"] == 0.5
    assert "'note' is not a number" in capsys.readouterr().err


def test_nonfinite_metrics_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLogger(tmp_path, enabled=True, tensorboard=True)
    log.scalars(1, {"loss/policy": float("nan"), "grad/norm": float("inf"), "solver/acc": 0.25})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss/policy", "grad/norm", "solver/acc"}
    assert math.isnan(acc.Scalars("loss/policy")[0].value) and acc.Scalars("grad/norm")[0].value == math.inf


def test_disabled_logger_writes_nothing(tmp_path):
    log = RunLogger(tmp_path / "off", enabled=False)
    log.scalars(0, {"a": float("nan")})
    log.close()
    assert not (tmp_path / "off").exists()


LOG_PROBE = """
import logging, sys
sys.path.insert(0, {repo!r})
from utils.logging import configure_logging
configure_logging({rank})
configure_logging({rank})          # twice: still one line per record
logging.getLogger("inference.judge").info("judge-info")
logging.getLogger("retrieval.client").warning("client-warning")
logging.getLogger("httpx").info("httpx-info")
logging.getLogger("bm25s").setLevel(logging.INFO)   # a library that sets its own level (bm25s does)
logging.getLogger("bm25s").info("bm25s-info")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_library_logging_names_the_rank_and_keeps_info_on_rank_0(rank):
    """Before, train.py configured no logging: library warnings came as bare lines from every rank and
    their info lines were lost."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    err = subprocess.run([sys.executable, "-c", LOG_PROBE.format(repo=str(repo), rank=rank)], capture_output=True,
                         text=True, check=True).stderr.splitlines()
    warn = [line for line in err if "client-warning" in line]
    assert len(warn) == 1 and warn[0].startswith(f"[rank{rank}] ") and "retrieval.client" in warn[0]
    assert sum("judge-info" in line for line in err) == (1 if rank == 0 else 0)
    assert not [line for line in err if "httpx-info" in line or "bm25s-info" in line]


def test_train_py_configures_logging_with_the_launchers_rank(monkeypatch):
    import train

    seen = []   # train.py imports configure_logging at its top: patched where main() looks it up
    monkeypatch.setattr(train, "configure_logging", lambda rank=0, stream=None: seen.append(rank))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        train.main(["--model_path", "/nonexistent-model"])
    assert seen == [3]


def test_eval_py_configures_logging_for_one_process(monkeypatch, tmp_path, tiny_model_dir):
    """eval.py used basicConfig at INFO on the root logger, so httpx printed a line for every judge and
    retriever request; it now takes the same set-up as train.py, as rank 0. The inputs are real (a model
    folder and a QA file): eval.py checks them before anything else and stops on a bad one."""
    import eval as E

    class Configured(Exception):
        pass

    def stop(rank=0, stream=None):
        raise Configured(rank)

    monkeypatch.setattr(E, "configure_logging", stop)   # eval.py imports it at its top: patched there
    (tmp_path / "qa.jsonl").write_text('{"question": "What is the capital of France?", "golden_answers": ["Paris"]}\n')
    with pytest.raises(Configured) as got:
        E.main(["--model", str(tiny_model_dir), "--data", str(tmp_path / "qa.jsonl"), "--out_dir", str(tmp_path / "o")])
    assert got.value.args == (0,)
