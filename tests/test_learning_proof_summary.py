"""bench/learning_proof.py: the numbers it reports follow from the run folder it reads."""

import json
import statistics

import pytest

pytest.importorskip("matplotlib")

import bench.report as report  # noqa: E402
from bench import learning_proof  # noqa: E402


def _src(em, n=5, title=0.0, copy=0.0, qt=0.0, hist=None):
    """One data source's eval.py group: EM and the title-heuristic fields."""
    hist = hist or {"1": 1.0}
    return {"n": n, "em": em, "title_baseline_em": title, "question_title_em": qt,
            "title_copy_at": {"1": copy, "2": 0.0, "3": 0.0}, "title_copy_any": copy, "title_ceiling": max(em, title),
            "searches_mean": sum(int(k) * v for k, v in hist.items()), "searches_hist": hist}


def _eval(path, overall_em, per_source):
    """per_source: data_source -> EM (a group as older evals wrote it) or a full group (_src)."""
    path.mkdir(parents=True)
    path.joinpath("results.json").write_text(json.dumps({
        "overall": {"n": 10, "em": overall_em},
        "per_source": {k: v if isinstance(v, dict) else {"n": 5, "em": v} for k, v in per_source.items()}}))


SFT_HIST = {"0": 0.2, "1": 0.6, "2": 0.2}  # 1.0 searches per question on the two-hop set


def _run_folder(root, finals, steps=4, mid=2, prefix="seed", rl="rl", ev="eval_step", sft_title=0.1,
                final_hist=None, twohop="twohop_heldout"):
    """finals: seed -> EM at step `steps` (overall and on each set); the step-`mid` eval sits halfway between SFT
    and it overall. prefix/rl/ev: rung 2's run folders and timing stages by default; rung 1's are
    qa_seed/rl_qa/eval_qa_step. The reading sets: capitals (5 questions) and the two-hop set (15), so the
    reading score is n-weighted: 12.5% at SFT; wiki_desc_heldout (old-style group) is not one of them."""
    if not (root / "eval_sft").exists():
        _eval(root / "eval_sft", 0.20, {"wiki_desc_heldout": 0.3, "capitals": _src(0.2, title=sft_title, copy=0.5, qt=0.2),
                                        twohop: _src(0.1, 15, title=sft_title / 2, copy=0.4, hist=SFT_HIST)})
    timings = ["sft\t600\t-", "eval_sft\t300\t-"] if not (root / "timings.tsv").exists() else []
    for seed, em in finals.items():
        final = {"wiki_desc_heldout": em, "capitals": _src(em, title=0.1, copy=0.2),
                 twohop: _src(em, 15, title=0.1, copy=0.2, hist=final_hist or {"1": 0.5, "2": 0.5})}
        _eval(root / f"{prefix}{seed}" / f"eval_step{steps}", em, final)
        _eval(root / f"{prefix}{seed}" / f"eval_step{mid}", (0.20 + em) / 2, final)
        lines = [json.dumps({"step": steps, "eval/em": 0.5})]  # an eval line: not a training step
        for s in range(1, steps + 1):
            lines.append(json.dumps({"step": s, "game/valid_rate": 0.5, "proposer/reward_mean": 0.1 * s,
                                     "solver/reward_mean": 0.2, "solver/acc": 0.25, "solver/fresh_trajs": 4.0,
                                     "solver/fresh_correct": float(s % 2), "game/solver_groups": 4.0,
                                     "game/informative_groups": 2.0 * (s % 2), "game/fresh_s0": 1.0,
                                     "game/fresh_mid": float(s % 2), "game/fresh_s1": 0.0}))
        lines.append(json.dumps({"step": 2, "game/valid_rate": 0.9, "proposer/reward_mean": 9.0,
                                 "solver/reward_mean": 0.2}))  # a resumed step 2 replaces the crashed one
        (root / f"{prefix}{seed}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        # the RL run in two pieces (milestones), both counted
        timings += [f"{rl}\t{400 + 60 * int(seed)}\t{seed}", f"{rl}\t500\t{seed}",
                    f"{ev}{mid}\t120\t{seed}", f"{ev}{steps}\t180\t{seed}"]
    with (root / "timings.tsv").open("a") as f:
        f.write("\n".join(timings) + "\n")


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_JSON", tmp_path / "results.json")
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    return tmp_path


def test_gain_spread_minutes_and_plot(tmp_path, results):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})
    png = tmp_path / "lp.png"
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4", "--png", str(png)]) == 0
    keys = json.loads((results / "results.json").read_text())
    gains = [10.0, 6.0, 8.0]
    assert keys["learning.solver_acc_gain"] == pytest.approx(statistics.mean(gains), abs=1e-3)
    assert keys["learning.seed_std"] == pytest.approx(statistics.stdev(gains), abs=1e-3)
    assert keys["learning.gain_by_step"] == {"2": pytest.approx(4.0, abs=1e-3), "4": pytest.approx(8.0, abs=1e-3)}
    # shared SFT + its eval (15 min) counted for every seed, plus that seed's RL pieces and both evals
    assert keys["learning.minutes_per_seed"] == pytest.approx(15 + statistics.mean([21, 22, 23]), abs=1e-2)
    # the primary metric: EM pooled n-weighted over capitals (5) and twohop_heldout (15): 12.5% at SFT
    rgains = [30 - 12.5, 26 - 12.5, 28 - 12.5]
    assert keys["learning.sft_reading_score"] == 12.5
    assert keys["learning.reading_score"] == {"1": 30.0, "2": 26.0, "3": 28.0}
    assert keys["learning.reading_gain"] == pytest.approx(statistics.mean(rgains), abs=1e-3)
    assert keys["learning.reading_seed_std"] == pytest.approx(statistics.stdev(rgains), abs=1e-3)
    assert keys["learning.reading_title_baseline"] == {"sft": 6.25, "final": 10.0}   # (5 x 10 + 15 x 5) / 20
    assert keys["learning.title_copy_share"] == {"sft": 42.5, "final": 20.0}         # (5 x 50 + 15 x 40) / 20
    assert keys["learning.searches_per_question"] == {"set": "twohop_heldout", "sft": {"mean": 1.0, "hist": SFT_HIST},
                                                      "final": {"mean": 1.5, "hist": {"1": 0.5, "2": 0.5}}}
    # the SFT eval against the title heuristic; wiki_desc_heldout's group predates the fields
    assert keys["learning_baseline.title_em"] == {"overall": 5.0, "wiki_desc_heldout": None, "capitals": 20.0,
                                                  "twohop_heldout": 0.0}
    assert keys["learning_baseline.title_em_own"] == {"overall": 6.25, "wiki_desc_heldout": None, "capitals": 10.0,
                                                      "twohop_heldout": 5.0}
    md = (results / "RESULTS.md").read_text()
    assert "## learning" in md and "## learning_baseline" in md and "+10.0" in md and "+17.5" in md
    assert "| reading % |" in md and "| EM capitals % |" in md and "| **reading (pooled)** |" in md
    assert "target (a): SFT reading score 12.5% > its title baseline 6.2%" in md
    assert "target (c)" in md and "rung 2, SSP: 1.00 -> 1.50" in md
    assert md.count("**met**") == 4 and "NOT met" not in md  # (a), (b), (c) in the rung, (c) over rungs; 8 > 2 x 2
    assert png.stat().st_size > 10_000


def test_title_baseline_and_searches_targets_can_fail(tmp_path, results):
    """SFT's own title baseline beats its reading score, and the two-hop set (FanOutQA here: no twohop_heldout)
    sees fewer searches after RL: targets (a) and (c) say NOT met; (b) still holds."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28}, sft_title=0.5, final_hist={"0": 0.5, "1": 0.5}, twohop="fanoutqa")
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4", "--png", str(tmp_path / "p.png")])
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning.searches_per_question"]["set"] == "fanoutqa"
    assert keys["learning.searches_per_question"]["final"] == {"mean": 0.5, "hist": {"0": 0.5, "1": 0.5}}
    assert keys["learning_baseline.title_em_own"]["overall"] == 31.25            # (5 x 50 + 15 x 25) / 20
    md = (results / "RESULTS.md").read_text()
    assert "target (a): SFT reading score 12.5% > its title baseline 31.2%" in md
    assert "(question-title baseline 5.0%): **NOT met**" in md
    assert "target (b) gain > 2 x std **met**" in md
    assert "target (c) rises from SFT **NOT met** in this rung" in md and "1.00 -> 0.50): **NOT met**" in md


def test_evals_without_reading_sets_say_not_measured(tmp_path, results):
    """Evals of an older layout (no reading sets, no title fields): the reading targets are n/a, not met."""
    out = tmp_path / "lp"
    _eval(out / "eval_sft", 0.2, {"a": 0.2})
    for s in ("1", "2"):
        for m in (2, 4):
            _eval(out / f"seed{s}" / f"eval_step{m}", 0.3, {"a": 0.3})
        (out / f"seed{s}" / "metrics.jsonl").write_text(json.dumps({"step": 1, "game/valid_rate": 0.5}) + "\n")
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "--steps", "2", "4", "--png", str(tmp_path / "p.png")])
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning.reading_gain"] is None and keys["learning.searches_per_question"]["set"] is None
    assert keys["learning_baseline.title_em"] == {"overall": None, "a": None}
    assert "n/a (not measured)" in (results / "RESULTS.md").read_text()


def test_resumed_step_replaces_the_crashed_line(tmp_path):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.2})
    rows = learning_proof.read_metrics(out / "seed1" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["proposer/reward_mean"] == 9.0


def test_spread_too_wide_says_not_met(tmp_path, results):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.40, "2": 0.20, "3": 0.21})
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4", "--png", str(tmp_path / "p.png")])
    assert "NOT met" in (results / "RESULTS.md").read_text()


def test_missing_seed_is_named(tmp_path, results):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.3})
    with pytest.raises(SystemExit, match="seed2/eval_step2"):
        learning_proof.main(["--out", str(out), "--seeds", "1", "2", "--steps", "2", "4", "--png", str(tmp_path / "p.png")])


def test_a_second_recipe_keeps_its_own_keys_and_section(tmp_path, results):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26})
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "--steps", "2", "4", "--png", str(tmp_path / "p.png"),
                         "--name", "learning_lr1e-4"])
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning_lr1e-4.solver_acc_gain"] == pytest.approx(8.0, abs=1e-3)
    assert not any(k.startswith("learning.") for k in keys)
    assert "## learning_lr1e-4" in (results / "RESULTS.md").read_text()


def test_fresh_question_accuracy_is_weighted_by_count():
    rows = [{"solver/fresh_trajs": 4.0, "solver/fresh_correct": 4.0}, {"solver/fresh_trajs": 0.0},
            {"solver/fresh_trajs": 12.0, "solver/fresh_correct": 0.0}]
    assert learning_proof.fresh_acc(rows) == pytest.approx(4 / 16)   # not the mean of 1.0 and 0.0
    import math
    assert math.isnan(learning_proof.fresh_acc([{"solver/fresh_trajs": 0.0}]))


def test_the_games_signal_is_read_off_its_summed_counts(tmp_path, results):
    """learning.informative_share / valid_rate / fresh_acc (issue 31): shares of counts summed over the steps,
    the resumed step's line in place of the crashed one (which had no counts), each seed alike."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26})
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "--steps", "2", "4", "--png", str(tmp_path / "p.png")])
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning.informative_share"] == pytest.approx(4 / 12, abs=1e-3)   # steps 1, 3, 4: 2 + 2 + 0 of 12
    assert keys["learning.valid_rate"] == pytest.approx(0.6, abs=1e-3)             # 0.5, 0.9 (resumed), 0.5, 0.5
    assert keys["learning.fresh_acc"] == pytest.approx(2 / 12, abs=1e-3)
    md = (results / "RESULTS.md").read_text()
    assert "informative share" in md and "fresh 0<s<1" in md and "informative solver groups 0.33 (- of the fresh" in md


def test_both_rl_rungs_get_their_own_sections_keys_and_one_plot(tmp_path, results):
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})                                     # rung 2
    _run_folder(out, {"1": 0.40, "2": 0.50, "3": 0.45}, prefix="qa_seed", rl="rl_qa", ev="eval_qa_step")  # rung 1
    for s in ("1", "2", "3"):   # both rungs reported: rung 2 against rung 1 at equal wall time reads the answers
        _examples(out / f"seed{s}" / "eval_step4", 6)
        _examples(out / f"qa_seed{s}" / "eval_step4", 8)
    png = tmp_path / "both.png"
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4",
                                "--qa_steps", "2", "4", "--png", str(png)]) == 0
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning_qa.solver_acc_gain"] == pytest.approx(statistics.mean([20.0, 30.0, 25.0]), abs=1e-3)
    assert keys["learning_qa.seed_std"] == pytest.approx(5.0, abs=1e-3)
    assert keys["learning.solver_acc_gain"] == pytest.approx(8.0, abs=1e-3)
    # each rung counts only its own RL and eval stages, beside the shared SFT
    assert keys["learning_qa.minutes_per_seed"] == keys["learning.minutes_per_seed"] == pytest.approx(
        15 + statistics.mean([21, 22, 23]), abs=1e-2)
    md = (results / "RESULTS.md").read_text()
    assert "## learning_qa" in md and "Rung 1" in md and "Rung 2" in md
    assert png.stat().st_size > 10_000


def _passk_eval(path, em, passk, meank, k=8):
    path.mkdir(parents=True)
    src = {"n": 4, "em": em, f"pass@{k}": passk, f"mean@{k}": meank}
    path.joinpath("results.json").write_text(json.dumps({"overall": src, "per_source": {"a": src}}))


def test_headroom_is_passk_minus_greedy_on_each_split(tmp_path, results):
    out = tmp_path / "lp"
    _eval(out / "eval_sft_dev", 0.40, {"a": 0.40})
    _passk_eval(out / "passk_dev", 0.38, 0.75, 0.38)
    _eval(out / "eval_sft_slice", 0.20, {"a": 0.20})
    _passk_eval(out / "passk_slice", 0.18, 0.30, 0.18)
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "--passk", "8"]) == 0
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning.sft_passk_gap"] == pytest.approx(35.0)
    assert keys["learning.sft_passk_gap_heldout"] == pytest.approx(10.0)
    assert "## learning_headroom" in (results / "RESULTS.md").read_text()
    with pytest.raises(SystemExit, match="eval_sft_dev"):
        learning_proof.main(["--out", str(tmp_path / "empty"), "--seeds", "1", "--passk", "8"])


def test_nothing_asked_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        learning_proof.main(["--out", str(tmp_path), "--seeds", "1"])


def _timed_metrics(run, steps, secs, teacher=0.0, cost_key="timing_s/teacher"):
    """Training-step lines with timing_s/step = secs (`cost_key`, the teacher's by default, of it) and a distill/kl
    column."""
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "game/valid_rate": 0.5, "timing_s/step": secs,
                                                           cost_key: teacher,
                                                           "distill/kl": 0.1, "solver/fresh_trajs": 2.0,
                                                           "solver/fresh_correct": 1.0}) + "\n"
                                               for s in range(1, steps + 1)))


def _examples(path, n_correct, n=20):
    """eval.py's examples.jsonl over the reading sets of _run_folder (capitals 5, twohop_heldout 15): the first
    n_correct questions right; one wiki_desc_heldout row, not a reading question, always right."""
    rows = [{"id": f"q{i}", "data_source": "capitals" if i < 5 else "twohop_heldout", "em": float(i < n_correct)}
            for i in range(n)] + [{"id": "w0", "data_source": "wiki_desc_heldout", "em": 1.0}]
    path.joinpath("examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rung3_against_rung2_at_equal_wall_time_with_a_paired_bootstrap(tmp_path, results):
    """Rung 3 steps cost 20 s, 10 s of them the teacher: rung 3's 4 steps buy 8 rung-2 steps; step 4 is rung 2's
    nearest milestone (and the report says step 8 was not run). Rung 2's own clock (10 s a step) is reported,
    not used. Rung 3 answers 2 more of the 20 reading
    questions than rung 2 on every seed: +10 points; the bootstrap's distribution is 5 x Binomial(20, 0.1) points,
    so its 2.5% and 97.5% points are 0 and 25 exactly (P(B = 0) = 0.12, P(B <= 4) = 0.957, P(B <= 5) = 0.989)."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})
    _run_folder(out, {"1": 0.40, "2": 0.38, "3": 0.42}, prefix="distill_seed", rl="rl_distill", ev="eval_distill_step")
    for s in ("1", "2", "3"):
        _timed_metrics(out / f"seed{s}", 4, 10.0)
        _timed_metrics(out / f"distill_seed{s}", 4, 20.0, teacher=10.0)
        _examples(out / f"seed{s}" / "eval_step4", 6)
        _examples(out / f"distill_seed{s}" / "eval_step4", 8)
    png = tmp_path / "three.png"
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4",
                                "--distill_steps", "2", "4", "--png", str(png)]) == 0
    keys = json.loads((results / "results.json").read_text())
    g3, g2 = [40 - 12.5, 38 - 12.5, 42 - 12.5], [30 - 12.5, 26 - 12.5, 28 - 12.5]
    assert keys["learning_distill.reading_gain"] == pytest.approx(statistics.mean(g3), abs=1e-3)
    assert keys["learning_distill.reading_seed_std"] == pytest.approx(statistics.stdev(g3), abs=1e-3)
    assert keys["learning_distill.gain_over_ssp"] == pytest.approx(statistics.mean(g3) - statistics.mean(g2), abs=1e-3)
    assert keys["learning_distill.gain_over_ssp_pooled_std"] == pytest.approx(
        ((statistics.variance(g3) + statistics.variance(g2)) / 2) ** 0.5, abs=1e-3)
    assert keys["learning_distill.gain_over_ssp_ci95"] == [0.0, 25.0]
    assert keys["learning_distill.ssp_equal_wall_step"] == 4 and keys["learning_distill.ssp_equal_wall_step_needed"] == 8
    assert keys["learning_distill.wall_minutes"] == {"distill": round(80 / 60, 2), "ssp": round(40 / 60, 2)}
    assert keys["learning_distill.teacher_time_share"] == 0.5
    # capitals (SFT 20%) is the only out-of-distribution set here
    o3 = [40 - 20, 38 - 20, 42 - 20]
    assert keys["learning_distill.ood_gain"] == pytest.approx(statistics.mean(o3), abs=1e-3)
    assert keys["learning_distill.ood_seed_std"] == pytest.approx(statistics.stdev(o3), abs=1e-3)
    md = (results / "RESULTS.md").read_text()
    assert "## learning_distill_vs_ssp" in md and "Rung 3" in md and "step 8 was not run" in md
    assert "paired bootstrap over the 20 reading-score questions" in md and "[+0.00, +25.00]" in md
    assert "target gain over rung 2 > 2 x pooled std **met**" in md
    assert png.stat().st_size > 10_000


def test_paired_bootstrap_of_identical_rungs_is_zero_and_ids_must_match():
    a = [{"q1": 1.0, "q2": 0.0}] * 3
    assert learning_proof.paired_bootstrap(a, a) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="share no question"):
        learning_proof.paired_bootstrap([{"q1": 1.0}], [{"q2": 1.0}])


def test_equal_wall_milestone_counts_the_teacher_share():
    """A rung-3 step of 30 s with a 10 s teacher: 10 rung-3 steps buy 15 rung-2 steps; the nearest milestone wins."""
    rows = [{"step": s, "timing_s/step": 30.0, "timing_s/teacher": 10.0} for s in range(1, 11)]
    runs = {"1": {"metrics": rows}}
    assert learning_proof.equal_wall_milestone(runs, 10, [10, 14]) == (14, 15, pytest.approx(1 / 3))
    assert learning_proof.equal_wall_milestone(runs, 10, [10, 15, 20])[:2] == (15, 15)
    # no teacher time (a run without distillation): the same step count
    plain = {"1": {"metrics": [{"step": s, "timing_s/step": 30.0} for s in range(1, 11)]}}
    assert learning_proof.equal_wall_milestone(plain, 10, [10, 15])[:2] == (10, 10)


def test_answer_habits_read_off_the_responses(tmp_path):
    """A year named before the first document (and not in the question) counts; one inside the question or after
    the documents does not; a loop is two identical consecutive thoughts; max_tokens stops are counted."""
    rows = [
        {"data_source": "reading_heldout", "question": "X was founded in what year?", "stop_reason": "answer",
         "response": "<think> X was founded in 1999. </think> <search> X 1999 </search> <information>...</information>"},
        {"data_source": "reading_heldout", "question": "Y won in 1950 and was built in what year?", "stop_reason": "answer",
         "response": "<search> Y 1950 </search> <information>built 1901</information> <answer> 1901 </answer>"},
        {"data_source": "reading_heldout", "question": "Where is Z?", "stop_reason": "max_tokens",
         "response": "<think> Z 1800 </think> <think> a </think> <think> a </think>"},
        {"data_source": "twohop_heldout", "question": "Q?", "stop_reason": "answer",
         "response": "<think> a </think> <think> b </think> <answer> c </answer>"},
        {"data_source": "capitals", "question": "in what year?", "stop_reason": "max_tokens",
         "response": "<think> 1999 </think> <think> 1999 </think>"}]
    (tmp_path / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = learning_proof.answer_habits(tmp_path / "examples.jsonl")
    assert h == {"year_before_docs": 50.0, "repeated_think": 25.0, "cut_at_max_tokens": 25.0}


def test_undefined_metrics_written_as_nan_strings_are_skipped():
    rows = [{"distill/kl": "nan"}, {"distill/kl": 0.2}, {"distill/kl": 0.4}, {}]
    assert learning_proof.mean_of("distill/kl")(rows) == pytest.approx(0.3)
    import math
    assert math.isnan(learning_proof.mean_of("distill/kl")([{"distill/kl": "nan"}]))


def test_critic_rung_against_rung1_at_the_step_its_critic_time_buys(tmp_path, results):
    """Rung 1gae steps cost 20 s, 15 s of them the critic: its 4 steps buy 16 rung-1 steps, the nearest rung-1
    milestone is step 8 (of 4 and 8), and rung 1 is read there, not at step 4 (where its EM differs). Rung 1gae answers
    2 fewer of the 20 reading questions than rung 1 at step 8 on every seed: -10 points."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.40, "2": 0.38, "3": 0.42}, steps=8, mid=4, prefix="qa_seed", rl="rl_qa", ev="eval_qa_step")
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28}, prefix="qa_gae_seed", rl="rl_qa_gae", ev="eval_qa_gae_step")
    for s in ("1", "2", "3"):
        _timed_metrics(out / f"qa_seed{s}", 8, 5.0)
        _timed_metrics(out / f"qa_gae_seed{s}", 4, 20.0, teacher=15.0, cost_key="timing_s/critic")
        _examples(out / f"qa_seed{s}" / "eval_step8", 8)
        _examples(out / f"qa_gae_seed{s}" / "eval_step4", 6)
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--qa_steps", "4", "8",
                                "--qa_gae_steps", "2", "4", "--png", str(tmp_path / "p.png")]) == 0
    keys = json.loads((results / "results.json").read_text())
    g_gae, g_qa = [30 - 12.5, 26 - 12.5, 28 - 12.5], [40 - 12.5, 38 - 12.5, 42 - 12.5]
    assert keys["learning_qa_gae.reading_gain"] == pytest.approx(statistics.mean(g_gae), abs=1e-3)
    assert keys["learning_qa_gae.reading_seed_std"] == pytest.approx(statistics.stdev(g_gae), abs=1e-3)
    assert keys["learning_qa_gae.minutes_per_seed"] == pytest.approx(15 + statistics.mean([21, 22, 23]), abs=1e-2)
    assert keys["learning_qa_gae.critic_time_share"] == 0.75
    assert keys["learning_qa_gae.qa_equal_wall_step"] == 8 and keys["learning_qa_gae.qa_equal_wall_step_needed"] == 16
    assert keys["learning_qa_gae.gain_over_qa"] == pytest.approx(statistics.mean(g_gae) - statistics.mean(g_qa), abs=1e-3)
    assert keys["learning_qa_gae.gain_over_qa_ci95"] == [-25.0, 0.0]
    assert keys["learning_qa_gae.wall_minutes"] == {"qa_gae": round(80 / 60, 2), "qa": round(40 / 60, 2)}
    md = (results / "RESULTS.md").read_text()
    assert "## learning_qa_gae_vs_qa" in md and "Rung 1gae against rung 1" in md
    assert "re-run rung 1 with QA_STEPS ending in 16" in md
    assert "target gain over rung 1 > 2 x pooled std **NOT met**" in md


def test_ssp_against_rung1_at_the_steps_its_wall_time_buys(tmp_path, results):
    """Issue 31: self-play against RL on labelled questions for the same training time. Rung 2 steps cost 30 s and
    rung 1 steps 10 s (each rung's own clock: they share no cost key), so rung 2's 4 steps buy 12 rung-1 steps and
    rung 1 is read at its milestone 12, not at 4 or 8. Rung 2 answers 3 more of the 20 reading questions on every
    seed: +15 points, and learning_ssp_vs_qa.gain / .ci95 carry the paired bootstrap."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})                                          # rung 2, steps 2, 4
    _run_folder(out, {"1": 0.40, "2": 0.38, "3": 0.42}, steps=12, mid=8, prefix="qa_seed", rl="rl_qa", ev="eval_qa_step")
    for s in ("1", "2", "3"):
        _timed_metrics(out / f"seed{s}", 4, 30.0)
        _timed_metrics(out / f"qa_seed{s}", 12, 10.0)
        _examples(out / f"seed{s}" / "eval_step4", 9)
        _examples(out / f"qa_seed{s}" / "eval_step12", 6)
        _examples(out / f"qa_seed{s}" / "eval_step8", 19)     # not the milestone the wall time buys
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4",
                                "--qa_steps", "8", "12", "--png", str(tmp_path / "p.png")]) == 0
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning_ssp.qa_equal_wall_step"] == 12 and keys["learning_ssp.qa_equal_wall_step_needed"] == 12
    assert keys["learning_ssp_vs_qa.gain"] == pytest.approx(15.0, abs=1e-3)
    lo, hi = keys["learning_ssp_vs_qa.ci95"]
    assert lo <= 15.0 <= hi and lo >= 0.0
    assert keys["learning_ssp.wall_minutes"] == {"ssp": 2.0, "qa": 2.0}
    md = (results / "RESULTS.md").read_text()
    assert "## learning_ssp_vs_qa" in md and "Rung 2 against rung 1" in md
    assert "rung 1's own median step (timing_s/step) sets the exchange rate" in md


def test_pre_registered_milestones_seed_level_intervals_and_records(tmp_path, results, monkeypatch):
    """Issue 41: a protocol that reads rung 2 at step 4 and rung 1 at step 8 reads them there, though rung 2's clock
    buys 12 rung-1 steps (the old rule's pick, still reported). Every difference gets a seed-level interval and an
    exact test over seeds beside the question-level one; each rung is set against SFT on the primary metric
    (capitals here); the runs' records (run_meta.jsonl) are listed."""
    import subprocess

    from bench import learning_compare
    proto = json.loads(learning_compare.PROTOCOL_FILE.read_text())
    proto["milestones"] = {"ssp": 4, "qa": 8}
    (tmp_path / "protocol.json").write_text(json.dumps(proto))
    monkeypatch.setattr(learning_compare, "PROTOCOL_FILE", tmp_path / "protocol.json")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=learning_compare.REPO).stdout.strip()
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})                                          # rung 2, steps 2, 4
    _run_folder(out, {"1": 0.40, "2": 0.38, "3": 0.42}, steps=12, mid=8, prefix="qa_seed", rl="rl_qa", ev="eval_qa_step")
    _examples(out / "eval_sft", 2)                        # SFT: 2 of the 5 capitals questions
    for s in ("1", "2", "3"):
        _timed_metrics(out / f"seed{s}", 4, 30.0)
        _timed_metrics(out / f"qa_seed{s}", 12, 10.0)
        _examples(out / f"seed{s}" / "eval_step4", 9 + int(s))     # every capitals question, 5-7 of 15 two-hop
        _examples(out / f"qa_seed{s}" / "eval_step8", 4)           # 4 of 5 capitals questions
        _examples(out / f"qa_seed{s}" / "eval_step12", 19)         # the clocks' pick: never read
        for pre in ("seed", "qa_seed"):
            (out / f"{pre}{s}" / "run_meta.jsonl").write_text(json.dumps(
                {"commit": head, "dirty": False, "argv": ["train.py", "--seed", s], "load1": 0.25}) + "\n")
        with (out / f"seed{s}" / "metrics.jsonl").open("a") as f:   # the dev split read in the run every 2 steps
            f.write("".join(json.dumps({"step": k, "eval/em": 0.1 * k + 0.01 * int(s)}) + "\n" for k in (2, 4)))
    assert learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4",
                                "--qa_steps", "8", "12", "--png", str(tmp_path / "p.png")]) == 0
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning_ssp_vs_qa.pre_registered"] is True
    assert keys["learning_ssp_vs_qa.milestones"] == {"ssp": 4, "qa": 8}
    assert keys["learning_ssp.qa_equal_wall_step"] == 8 and keys["learning_ssp.qa_equal_wall_step_needed"] == 12
    # primary metric: 5 of 5 against 4 of 5 capitals on every seed, +20 points; 3 against 3 seeds: p = 2/20
    assert keys["learning_ssp_vs_qa.ood_gain"] == pytest.approx(20.0)
    assert keys["learning_ssp_vs_qa.ood_p_seed"] == pytest.approx(0.1)
    lo, hi = keys["learning_ssp_vs_qa.ood_ci95_seed"]
    assert lo <= 20.0 <= hi
    # the reading score: (10, 11, 12) of 20 against 4 of 20 -> +35 points; seed-level interval wider than the
    # question-level one where the seeds differ
    assert keys["learning_ssp_vs_qa.gain"] == pytest.approx(35.0)
    seed_ci, q_ci = keys["learning_ssp_vs_qa.reading_ci95_seed"], keys["learning_ssp_vs_qa.reading_ci95_question"]
    assert seed_ci[1] - seed_ci[0] >= q_ci[1] - q_ci[0] and keys["learning_ssp_vs_qa.reading_p_seed"] == pytest.approx(0.1)
    # each rung against SFT at its protocol milestone: rung 2 +60 points on capitals, sign flips 2 of 8
    assert keys["learning.ood_gain"] == pytest.approx(60.0) and keys["learning.ood_p_seed"] == pytest.approx(0.25)
    assert keys["learning.pre_registered"] is True and keys["learning.decision_step"] == 4
    assert keys["learning_qa.decision_step"] == 8 and keys["learning_qa.ood_gain"] == pytest.approx(40.0)
    assert keys["learning.run_commits"] == {"1": [head], "2": [head], "3": [head]}
    assert keys["learning.dev_em_by_step"] == {"2": 22.0, "4": 42.0} and "learning_qa.dev_em_by_step" not in keys
    md = (results / "RESULTS.md").read_text()
    assert "Milestones pre-registered in bench/learning_protocol.json" in md and "Not pre-registered" not in md
    assert "seed-level 95% interval (two-level bootstrap" in md and "smallest possible 0.100" in md
    assert f"training runs at commit(s) {head[:10]}" in md and "load at launch 0.25-0.25" in md
    assert "step 2: 22.0% (21.0, 22.0, 23.0); step 4: 42.0% (41.0, 42.0, 43.0)" in md
    # the ladder's sections name the code they measure, so bench/report.py --check can flag them
    sections = keys["_sections"]
    assert all(sections[s]["measures"] == sorted(learning_compare.LADDER_MEASURES)
               for s in ("learning", "learning_qa", "learning_ssp_vs_qa", "learning_baseline"))


def test_milestones_chosen_from_the_clocks_say_so(tmp_path, results):
    """Without the protocol's milestones in the runs, the old rule reads them, and the section says it was not
    pre-registered."""
    out = tmp_path / "lp"
    _run_folder(out, {"1": 0.30, "2": 0.26, "3": 0.28})
    _run_folder(out, {"1": 0.40, "2": 0.38, "3": 0.42}, steps=12, mid=8, prefix="qa_seed", rl="rl_qa", ev="eval_qa_step")
    for s in ("1", "2", "3"):
        _timed_metrics(out / f"seed{s}", 4, 30.0)
        _timed_metrics(out / f"qa_seed{s}", 12, 10.0)
        _examples(out / f"seed{s}" / "eval_step4", 9)
        _examples(out / f"qa_seed{s}" / "eval_step12", 6)
    learning_proof.main(["--out", str(out), "--seeds", "1", "2", "3", "--steps", "2", "4", "--qa_steps", "8", "12",
                         "--png", str(tmp_path / "p.png")])
    keys = json.loads((results / "results.json").read_text())
    assert keys["learning_ssp_vs_qa.pre_registered"] is False and keys["learning.pre_registered"] is False
    md = (results / "RESULTS.md").read_text()
    assert "**Not pre-registered:**" in md and "hold no run_meta.jsonl" in md
