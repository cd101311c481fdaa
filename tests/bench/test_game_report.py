"""bench/game_report.py: each share is a ratio of the counts summed over a run's steps, checked by hand."""

import json

import pytest

import bench.report as report
from bench import game_report


def _run(path, steps, cfg=None):
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **s}) + "\n" for i, s in enumerate(steps))
                                              + json.dumps({"step": 2, "eval/em": 0.5}) + "\n")   # an eval line
    if cfg:
        path.joinpath("config.json").write_text(json.dumps(cfg))


def test_shares_are_of_summed_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_JSON", tmp_path / "results.json")
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    a = {"game/valid_rate": 0.25, "game/proposer_trajs": 8.0, "game/valid_questions": 2.0, "game/solver_groups": 4.0,
         "game/informative_groups": 1.0, "solver/fresh_trajs": 16.0, "solver/fresh_correct": 2.0, "game/fresh_s0": 1.0,
         "game/fresh_mid": 1.0, "game/fresh_s1": 0.0, "game/filter/no_question": 4.0, "game/no_question/turn_cap": 1.0,
         "game/no_question/out_of_turns": 3.0, "game/pool_fills": 2.0, "game/pool_repeats": 1.0}
    b = {"game/valid_rate": 0.75, "game/proposer_trajs": 4.0, "game/valid_questions": 3.0, "game/solver_groups": 6.0,
         "game/informative_groups": 5.0, "solver/fresh_trajs": 24.0, "solver/fresh_correct": 12.0, "game/fresh_s0": 0.0,
         "game/fresh_mid": 3.0, "game/fresh_s1": 0.0, "game/filter/no_question": 0.0, "game/pool_fills": 0.0}
    _run(tmp_path / "r", [a, b], {"selfplay": {"rag_verify": "policy", "proposer_reward": "1-acc", "format_penalty": 0.0}})
    (tmp_path / "r" / "dev").mkdir()
    (tmp_path / "r" / "dev" / "results.json").write_text(json.dumps({"overall": {"n": 4, "em": 0.25}}))
    s = game_report.summarise(tmp_path / "r")
    assert s["dev_em"] == pytest.approx(25.0)
    # a ladder run's dev evals sit in dev_step<N>: the last step's is read (step 30, not step 5)
    for step, em in ((5, 0.5), (30, 0.75)):
        (tmp_path / "l" / f"dev_step{step}").mkdir(parents=True)
        (tmp_path / "l" / f"dev_step{step}" / "results.json").write_text(json.dumps({"overall": {"em": em}}))
    assert game_report.dev_em(tmp_path / "l") == pytest.approx(75.0)
    assert s["steps"] == 2
    assert s["valid_rate"] == pytest.approx(5 / 12)          # not the mean of 0.25 and 0.75
    assert s["informative_share"] == pytest.approx(6 / 10)
    assert s["fresh_acc"] == pytest.approx(14 / 40)
    assert (s["fresh_s0"], s["fresh_mid"], s["fresh_s1"]) == pytest.approx((1 / 5, 4 / 5, 0.0))
    assert s["filter/no_question"] == pytest.approx(4 / 12) and s["pool_repeats"] == pytest.approx(1 / 2)
    assert s["recipe"].startswith("rag policy, 1-acc, penalty 0.0")
    assert game_report.main(["--run", f"x={tmp_path / 'r'}", "--section", "g", "--note", "why"]) == 0
    keys = json.loads((tmp_path / "results.json").read_text())
    assert keys["g.x"]["valid_rate"] == pytest.approx(5 / 12) and keys["g.x"]["valid_one_search"] is None   # nothing probed: no value, not 0
    md = (tmp_path / "RESULTS.md").read_text()
    assert "## g" in md and "why" in md and "| x | rag policy" in md and "| 0.42 |" in md
    with pytest.raises(SystemExit):
        game_report.main(["--run", "no-label"])


def test_slots_kinds_commit_and_keep(tmp_path, monkeypatch):
    """Informative groups per proposer slot count the empty slots (fresh groups, then pool replays too); the valid
    rate by answer kind is of that kind's rollouts; each row names the commit its run recorded; --keep re-renders
    the rows the section already holds, replacing one re-run under its label."""
    monkeypatch.setattr(report, "RESULTS_JSON", tmp_path / "results.json")
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    a = {"game/valid_rate": 0.375, "game/proposer_trajs": 8.0, "game/valid_questions": 3.0, "game/solver_slots": 8.0,
         "game/solver_groups": 6.0,
         "game/informative_groups": 4.0, "game/informative_groups/fresh": 1.0, "game/proposer_trajs/name": 5.0,
         "game/valid_questions/name": 1.0, "game/proposer_trajs/fact": 3.0, "game/valid_questions/fact": 2.0}
    b = {"game/valid_rate": 0.0, "game/proposer_trajs": 8.0, "game/valid_questions": 0.0, "game/solver_slots": 8.0,
         "game/solver_groups": 0.0,
         "game/informative_groups": 0.0, "game/informative_groups/fresh": 0.0, "game/proposer_trajs/name": 8.0,
         "game/valid_questions/name": 0.0}                                # a step of empty slots only
    _run(tmp_path / "r", [a, b])
    (tmp_path / "r" / "run_meta.jsonl").write_text(json.dumps({"commit": "abcdef1234567890", "argv": []}) + "\n")
    s = game_report.summarise(tmp_path / "r")
    assert s["informative_per_slot"] == pytest.approx(1 / 16) and s["informative_per_slot_all"] == pytest.approx(4 / 16)
    assert s["valid_rate_by_kind"] == pytest.approx({"fact": 2 / 3, "name": 1 / 13})
    assert s["commit"] == "abcdef1234567890"

    # an older section: one row written before rows carried a commit (the section's stamp stands in), one re-run
    report.write_results("g", {"g.old": {**s, "commit": None, "valid_rate_by_kind": None, "recipe": "old recipe",
                                         "informative_per_slot": None},
                               "g.x": {**s, "recipe": "stale"}}, "old table")
    data = json.loads((tmp_path / "results.json").read_text())
    data["_sections"]["g"]["commit"] = "0123456789abcdef"
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert game_report.main(["--run", f"x={tmp_path / 'r'}", "--section", "g", "--keep"]) == 0
    md = (tmp_path / "RESULTS.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| old") or line.startswith("| x")]
    assert len(rows) == 2 and rows[0].startswith("| old | old recipe") and rows[1].startswith("| x | rag ?")
    assert "`0123456789`" in rows[0] and "`abcdef1234`" in rows[1] and "stale" not in md
    assert "| fact 0.67, name 0.08 |" in rows[1] and "| 0.06 / 0.25 |" in rows[1] and "| - / 0.25 |" in rows[0]
    keys = json.loads((tmp_path / "results.json").read_text())
    assert keys["g.old"]["commit"] == "0123456789abcdef" and keys["g.x"]["valid_rate_by_kind"]["fact"] == pytest.approx(2 / 3)
    # without --keep the section holds only the runs given
    assert game_report.main(["--run", f"x={tmp_path / 'r'}", "--section", "g"]) == 0
    assert "| old |" not in (tmp_path / "RESULTS.md").read_text()
