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
