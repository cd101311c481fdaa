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
