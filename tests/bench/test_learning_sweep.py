"""bench/learning_sweep.py and scripts/learning_sweep_cpu.sh run issue 41's sweep by the committed protocol's rule:
stage by stage, the highest mean dev EM over the sweep seeds, a tie to the candidate listed first, later challengers
built from the winner so far. Checked on run folders that hold only the dev results the rule reads."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.learning_compare import load_protocol
from bench.learning_sweep import FULL_SLOTS, plan

REPO = Path(__file__).resolve().parents[2]
PROTO = load_protocol(REPO / "bench" / "learning_protocol.json")


def _dev(out: Path, label: str, ems: tuple[float, float]) -> None:
    for seed, em in zip(PROTO["sweep"]["seeds"], ems):
        d = out / f"sweep_{label}_seed{seed}" / f"dev_step{PROTO['sweep']['steps']}"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"overall": {"em": em}}))


def test_the_sweep_walks_the_stages_and_keeps_the_incumbent_on_a_tie(tmp_path):
    assert plan(PROTO, tmp_path)["next"] == ("A", "--rag_verify policy --shortcut_filter off")
    _dev(tmp_path, "A", (0.10, 0.20))
    assert plan(PROTO, tmp_path)["next"][0] == "B"   # a candidate's seeds all finished before the next
    _dev(tmp_path, "B", (0.20, 0.20))
    _dev(tmp_path, "C", (0.25, 0.15))    # C's mean equals B's: B, listed first, keeps it
    p = plan(PROTO, tmp_path)
    assert [round(sc, 3) for _, sc in p["stages"][0].values()] == [0.15, 0.2, 0.2]
    assert p["next"] == ("D", "--rag_verify retrieval --shortcut_filter both")
    _dev(tmp_path, "D", (0.30, 0.20))   # D beats B
    assert plan(PROTO, tmp_path)["next"] == ("E", f"--rag_verify retrieval --shortcut_filter both {FULL_SLOTS}")
    _dev(tmp_path, "E", (0.25, 0.25))   # a tie with the incumbent D: D stays
    p = plan(PROTO, tmp_path)
    assert p["next"] is None and p["chosen"] == ("D", "--rag_verify retrieval --shortcut_filter both")


def test_a_protocol_whose_words_the_rules_do_not_know_is_refused(tmp_path):
    proto = json.loads(json.dumps(PROTO))
    proto["sweep"]["stages"][1]["candidates"]["D"] = "the stage-1 winner's flags with --shortcut_filter title"
    for label in "ABC":
        _dev(tmp_path, label, (0.1, 0.1))
    with pytest.raises(ValueError, match="neither rule"):
        plan(proto, tmp_path)


def test_the_script_says_what_runs_next_and_what_was_chosen(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), DRY_RUN="1")
    run = lambda: subprocess.run(["bash", "scripts/learning_sweep_cpu.sh"], cwd=REPO, env=env, capture_output=True,  # noqa: E731
                                 text=True, timeout=120)
    r = run()
    assert r.returncode == 0 and "next candidate A: --rag_verify policy --shortcut_filter off (seeds 101 102, 30 steps)" \
        in r.stdout, r.stdout + r.stderr
    for label, ems in (("A", (0.3, 0.3)), ("B", (0.1, 0.1)), ("C", (0.1, 0.1)), ("D", (0.1, 0.1)), ("E", (0.2, 0.2))):
        _dev(tmp_path, label, ems)
    r = run()
    assert r.returncode == 0 and "chose A: --rag_verify policy --shortcut_filter off" in r.stdout, r.stdout + r.stderr


def _steps(out: Path, label: str, seconds: list[float]) -> None:
    """Both seeds' metrics.jsonl: one training line a step with its timing_s/step, and an eval line."""
    for seed in PROTO["sweep"]["seeds"]:
        lines = [{"step": i + 1, "timing_s/step": t} for i, t in enumerate(seconds)] + [{"step": 10, "eval/em": 0.3}]
        (out / f"sweep_{label}_seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_amend_writes_the_choice_and_only_the_choice(tmp_path):
    from bench.learning_sweep import amend
    proto_file = tmp_path / "protocol.json"
    before = (REPO / "bench" / "learning_protocol.json").read_text()
    proto_file.write_text(before)
    _dev(tmp_path, "A", (0.3, 0.3))
    with pytest.raises(ValueError, match="candidate B runs next"):
        amend(proto_file, tmp_path)
    for label in "BCDE":
        _dev(tmp_path, label, (0.1, 0.1))
    said = amend(proto_file, tmp_path)
    after = json.loads(proto_file.read_text())
    assert said.startswith("chose A") and after["arms"]["ssp"]["flags"] == "--rag_verify policy --shortcut_filter off"
    assert after["milestones"] == PROTO["milestones"] and after["status"].startswith("amended once: the sweep chose candidate A")
    changed = [(a, b) for a, b in zip(before.splitlines(), proto_file.read_text().splitlines()) if a != b]
    assert len(changed) == 2 and len(before.splitlines()) == len(proto_file.read_text().splitlines())   # flags, status
    with pytest.raises(ValueError, match="amended"):
        amend(proto_file, tmp_path)


def test_amend_for_candidate_e_keeps_ssps_training_minutes(tmp_path):
    """E plays up to two rounds a step: its milestone is 30 x t_ref / t_E, by the median step time of the sweep's runs
    of E and of the candidate it beat (D here), the distill milestone scaled alike; the eval lines do not count."""
    proto_file = tmp_path / "protocol.json"
    proto_file.write_text((REPO / "bench" / "learning_protocol.json").read_text())
    for label, ems in (("A", (0.2, 0.2)), ("B", (0.1, 0.1)), ("C", (0.1, 0.1)), ("D", (0.3, 0.3)), ("E", (0.4, 0.4))):
        _dev(tmp_path, label, ems)
    _steps(tmp_path, "D", [40.0, 42.0, 500.0])   # median 42 (a paused step does not move it)
    _steps(tmp_path, "E", [60.0, 63.0, 70.0])    # median 63
    r = subprocess.run([".venv/bin/python", "-m", "bench.learning_sweep", "--out", str(tmp_path), "--protocol",
                        str(proto_file), "--amend"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    after = json.loads(proto_file.read_text())
    assert after["arms"]["ssp"]["flags"] == f"--rag_verify policy --shortcut_filter both {FULL_SLOTS}"
    ms = PROTO["milestones"]
    assert after["milestones"] == {**ms, "ssp": round(ms["ssp"] * 42 / 63), "distill": round(ms["distill"] * 42 / 63)}
    assert after["milestones"]["ssp"] == 20 and "ssp 30 -> 20" in r.stdout
