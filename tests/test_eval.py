"""eval.py end to end: the real CLI on a slice of the bundled sets, with a real BM25 index; and the
in-process path the trainer reuses (inference/evaluate.py), checked against a recomputation from its examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EVAL_SETS = ["data/eval/capitals.jsonl", "data/eval/fanoutqa_singlehop.jsonl"]
PROTOCOL_KEYS = ("model", "engine", "retriever", "topk", "max_turns", "token_caps", "template", "judge", "sampling", "examples",
                 "schedule")


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory) -> Path:
    """BM25 over the first 300 documents of the demo corpus (data/corpus/wiki.jsonl)."""
    from retrieval.build_index import build_index

    tmp = tmp_path_factory.mktemp("eval_index")
    lines = (REPO / "data/corpus/wiki.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    (tmp / "wiki300.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    build_index(tmp / "wiki300.jsonl", tmp / "bm25", "bm25")
    return tmp / "bm25"


def check_outputs(out: Path, n: int, sources: set[str]) -> dict:
    res = json.loads((out / "results.json").read_text())
    assert tuple(res["protocol"])[: len(PROTOCOL_KEYS)] == PROTOCOL_KEYS
    assert set(res["per_source"]) == sources and res["overall"]["n"] == n
    examples = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert len(examples) == n
    # the summary is recomputed from the per-example lines, not trusted
    for key, col in (("em", "em"), ("f1", "f1"), ("sub_em", "sub_em"), ("judge_acc", "judge_correct"),
                     ("turns_mean", "turns"), ("searches_mean", "searches")):
        assert res["overall"][key] == pytest.approx(sum(float(e[col]) for e in examples) / n, abs=1e-4)
    for src in sources:
        assert res["per_source"][src]["n"] == sum(e["data_source"] == src for e in examples)
    for e in examples:
        assert e["turns"] >= 1 and e["em"] in (0.0, 1.0) and 0.0 <= e["f1"] <= 1.0
        assert e["judge_correct"] == bool(e["em"])       # exact-match judge: no server given
    for m in [res["overall"], *res["per_source"].values()]:   # the title heuristic, recomputed where it is simple
        assert {"1", "2", "3"} <= set(m["title_copy_at"]) and sum(m["searches_hist"].values()) == pytest.approx(1, abs=1e-3)
        assert 0.0 <= m["title_baseline_em"] <= m["title_ceiling"] <= 1.0 and m["title_copy_at"]["1"] <= m["title_copy_any"]
    for e in examples:
        assert len(e["doc_titles"]) == e["searches"]
    from utils.text import exact_match
    assert res["overall"]["title_ceiling"] == pytest.approx(sum(any(exact_match(t, e["golden_answers"]) for d in e["doc_titles"]
                                                                    for t in d) for e in examples) / n, abs=1e-4)
    md = (out / "results.md").read_text()
    assert md.index("## Protocol") < md.index("## Results") < md.index("## Title heuristic")
    assert "| **overall** |" in md and all(f"| {s} |" in md for s in sources)
    return res


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_end_to_end_vllm_bm25(smollm2_dir, bm25_index, tmp_path):
    out = tmp_path / "ev"
    cmd = [sys.executable, "eval.py", "--model", str(smollm2_dir), "--data", *EVAL_SETS, "--limit", "4",
           "--index", str(bm25_index), "--topk", "2", "--max_turns", "2", "--max_tokens_per_turn", "48",
           "--max_total_tokens", "1536", "--max_model_len", "2048", "--out_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the protocol is printed before anything is run, and heads the markdown report
    head = proc.stdout.split("Evaluation protocol:", 1)[1]
    assert f"- model: {smollm2_dir.resolve()}" in head
    assert f"- retriever: bm25 index at {bm25_index} (300 docs)" in head
    for line in ("- topk: 2", "- max_turns: 2", "- template: auto", "- judge: exact match only",
                 "- sampling: greedy (temperature 0)", "- examples: 8 from"):
        assert line in head
    res = check_outputs(out, 8, {"capitals", "fanoutqa_single"})
    assert res["protocol"]["engine"] == "vllm (float32)"
    assert json.loads((out / "config.json").read_text())["limit"] == 4


@pytest.mark.timeout(300)
def test_cli_in_process_hf_engine_no_search(tiny_model_dir, tmp_path):
    import eval as eval_cli

    out = tmp_path / "ev_hf"
    rc = eval_cli.main(["--model", str(tiny_model_dir), "--engine", "hf", "--data", EVAL_SETS[0], "--limit", "3",
                        "--max_turns", "2", "--max_tokens_per_turn", "16", "--out_dir", str(out)])
    assert rc == 0
    res = check_outputs(out, 3, {"capitals"})
    assert res["protocol"]["retriever"] == "none (no search tool)"
    assert res["overall"]["searches_mean"] == 0.0


def test_evaluate_groups_by_source(tiny_model_dir):
    from inference.evaluate import EvalConfig, evaluate
    from inference.data import EvalRow
    from inference.hf_engine import HFEngine
    from inference.rollout import RolloutConfig

    rows = [EvalRow("What is the capital of France?", ["Paris"], "a", "1"),
            EvalRow("Who wrote Hamlet?", ["Shakespeare"], "b", "2"),
            EvalRow("What is 2+2?", ["4", "four"], "a", "3")]
    cfg = EvalConfig(rollout=RolloutConfig(max_turns=1, max_tokens_per_turn=8, temperature=0.0), batch_size=2,
                     progress=False)
    res = evaluate(HFEngine(tiny_model_dir), rows, None, cfg)
    assert [e["id"] for e in res["examples"]] == ["1", "2", "3"]
    assert res["per_source"]["a"]["n"] == 2 and res["per_source"]["b"]["n"] == 1 and res["overall"]["n"] == 3
    assert all(e["turns"] == 1 and e["searches"] == 0 for e in res["examples"])


def test_a_prompt_over_the_budget_names_its_row(tiny_model_dir):
    """A question whose prompt fills the token budget is refused with its file and line, before any rollout:
    by prompt_budget_error (what eval.py runs before the model loads; a huge question is measured cut) and by
    evaluate() itself (the trainer's periodic eval), never by the rollout loop's bare ValueError."""
    from transformers import AutoTokenizer

    from inference.data import EvalRow
    from inference.evaluate import EvalConfig, evaluate, prompt_budget_error
    from inference.rollout import RolloutConfig
    from utils.errors import InputError

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class NoGeneration:
        tokenizer, max_model_len = tok, 256

        def generate(self, prompts, samplings):
            raise AssertionError("a rollout ran")

    rows = [EvalRow("What is the capital of France?", ["Paris"], "a", "0", where="q.jsonl: line 1"),
            EvalRow("word " * 300, ["x"], "a", "1", where="q.jsonl: line 2"),
            EvalRow("word " * 200_000, ["x"], "b", "2")]        # built in code: known by its id
    cfg = EvalConfig(rollout=RolloutConfig(max_turns=1, max_total_tokens=1024), progress=False)
    err = prompt_budget_error(tok, rows, cfg, max_model_len=256)
    text = str(err)
    assert text.startswith("2 questions too long: a prompt at or over the budget of 256 tokens (the smaller of "
                           "--max_total_tokens 1024 and --max_model_len 256)")
    assert "q.jsonl: line 2: the question is 1,500 characters and its prompt has " in text and "line 1" not in text
    assert "row id 2 of b: the question is 1,000,000 characters and its prompt has at least " in text
    assert "shorten the question or drop the row" in text
    assert prompt_budget_error(tok, rows[:1], cfg, max_model_len=256) is None
    with pytest.raises(InputError, match="q.jsonl: line 2: the question is 1,500 characters"):
        evaluate(NoGeneration(), rows, None, cfg)


def test_cli_refuses_bad_flags(tmp_path, capsys):
    import eval as eval_cli

    base = ["--model", "m", "--data", "d.jsonl", "--out_dir", str(tmp_path)]
    for extra, msg in ((["--index", "i", "--retriever_url", "http://x"], "choose one search backend"),
                       (["--self_search", "--simulated"], "got --self_search and --simulated"),
                       (["--sim_url", "http://x"], "--simulated, which is not set"),
                       (["--limit", "0"], "--limit must be >= 1"),
                       (["--index", str(tmp_path / "nope")], "is not a built index"),
                       (["--max_total_tokens", "9000"], "exceeds --max_model_len"),
                       (["--samples", "0"], "--samples must be >= 1"),
                       (["--max_inflight", "-1"], "--max_inflight must be >= 0"),
                       (["--max_turns", "0"], "--max_turns must be >= 1, got 0"),
                       (["--topk", "0"], "--topk must be >= 1, got 0"),
                       (["--batch_size", "0"], "--batch_size must be >= 1, got 0"),
                       (["--samples", "3"], "--samples 3 needs --temperature > 0"),
                       (["--samples", "3", "--temperature", "0"], "greedy decoding (--temperature 0)")):
        with pytest.raises(SystemExit):
            eval_cli.parse_args(base + extra)
        assert msg in capsys.readouterr().err


def test_cli_refuses_to_replace_an_earlier_eval(tmp_path, capsys):
    """An --out_dir holding any output of an earlier eval is refused without --overwrite (before the
    model is loaded); files eval.py never writes (a wrapper's tee'd log) do not count."""
    import eval as eval_cli

    out = tmp_path / "ev"
    out.mkdir()
    (out / "eval.log").write_text("scripts/eval.sh tees its log here before eval.py starts\n")
    base = ["--model", "m", "--data", "d.jsonl", "--out_dir", str(out)]
    assert eval_cli.parse_args(base).out_dir == str(out)
    for name in ("results.json", "results.md", "examples.jsonl", "config.json"):
        (out / name).write_text("{}\n")
        with pytest.raises(SystemExit):
            eval_cli.parse_args(base)
        err = capsys.readouterr().err
        assert f"already holds {name}" in err and "--overwrite" in err and "another --out_dir" in err
        assert eval_cli.parse_args(base + ["--overwrite"]).overwrite
        (out / name).unlink()
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--model", "m", "--data", "d.jsonl", "--out_dir", str(tmp_path / "f")])
    assert "is a file" in capsys.readouterr().err


# ---- --samples K: pass@K headroom -------------------------------------------------------------

def test_pass_at_k_by_hand_and_by_enumeration():
    """Chen et al.'s 1 - C(n-c,k)/C(n,k) against hand-computed values, then against its definition: the
    fraction of the k-subsets of the n samples that hold a correct one."""
    import itertools
    import random

    from inference.evaluate import pass_at_k, pass_ks

    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)                 # c/n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)           # C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)                  # C(3,2)/C(4,2) = 3/6
    assert pass_at_k(8, 1, 4) == pytest.approx(0.5)                  # C(7,4)/C(8,4) = 35/70
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 7)
        flags = [rng.random() < 0.3 for _ in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(flags, k))
            assert pass_at_k(n, sum(flags), k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    assert pass_ks(1) == [1] and pass_ks(3) == [1, 2, 3] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(10) == [1, 2, 4, 8, 10]


def test_group_metrics_pass_and_mean_by_hand():
    """Three questions, K = 4, correct 0/4, 1/4 and 3/4: pass@4 = 2/3, mean@4 = 4/12; the other metrics
    run over all 12 samples."""
    from inference.evaluate import SAMPLE_FIELDS, _group_metrics

    def q(correct: list[bool]) -> dict:
        rec = {key: [None] * 4 for key in SAMPLE_FIELDS}
        rec.update(em=[float(c) for c in correct], f1=[float(c) for c in correct], sub_em=[float(c) for c in correct],
                   judge_correct=correct, judge_failed=[False] * 4, turns=[1, 2, 1, 2], searches=[0, 1, 0, 1],
                   pred=["x" if c else None for c in correct])
        return rec

    m = _group_metrics([q([False] * 4), q([False, True, False, False]), q([True, True, False, True])], 4)
    assert m["n"] == 3 and m["pass@4"] == pytest.approx(2 / 3, abs=1e-4) and m["mean@4"] == pytest.approx(4 / 12, abs=1e-4)
    assert m["em"] == m["judge_acc"] == m["mean@4"] and m["turns_mean"] == 1.5 and m["searches_mean"] == 0.5
    assert m["no_answer_rate"] == pytest.approx(8 / 12, abs=1e-4)
    # k = 1: c/4 averaged; k = 2: 1 - C(4-c,2)/6 = 0, 1/2, 1 -> 1/2; k = 4: pass@4
    assert m["pass@k_unbiased"] == {"1": m["mean@4"], "2": 0.5, "4": m["pass@4"]}


def test_evaluate_config_refuses_greedy_samples():
    from inference.evaluate import EvalConfig
    from inference.rollout import RolloutConfig

    with pytest.raises(ValueError, match="temperature"):
        EvalConfig(samples=3)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        EvalConfig(rollout=RolloutConfig(temperature=1.0), samples=0)


@pytest.mark.timeout(300)
def test_cli_samples_pass_at_k_hf_engine(tiny_model_dir, tmp_path, capsys):
    """--samples 3 --temperature 1 on a random model: one examples line per question holding 3 samples, each
    drawn with its own seed (so they differ), pass@3 / mean@3 in results.json and results.md; the same seed
    reproduces the run. The random model's answers are never right, so the metrics are 0, but consistent."""
    import eval as eval_cli
    from inference import engine_api, hf_engine

    seeds: list[int | None] = []
    real = hf_engine.HFEngine.generate

    def spy(self, prompts, sampling):
        seeds.extend(s.seed for s in engine_api.per_prompt_sampling(sampling, len(prompts)))
        return real(self, prompts, sampling)

    args = ["--model", str(tiny_model_dir), "--engine", "hf", "--data", EVAL_SETS[0], "--limit", "2", "--max_turns", "2",
            "--max_tokens_per_turn", "12", "--samples", "3", "--temperature", "1.0", "--seed", "7"]
    hf_engine.HFEngine.generate = spy
    try:
        assert eval_cli.main(args + ["--out_dir", str(tmp_path / "a")]) == 0
    finally:
        hf_engine.HFEngine.generate = real
    assert "eval (3 samples/q)" in capsys.readouterr().err
    first_turn = seeds[:6]                                  # 2 questions x 3 samples, turn 0
    assert None not in first_turn and len(set(first_turn)) == 6
    res = json.loads((tmp_path / "a/results.json").read_text())
    assert res["protocol"]["sampling"] == "temperature 1.0, seed 7, 3 samples per question"
    for m in [res["overall"], *res["per_source"].values()]:
        assert 0.0 <= m["mean@3"] <= m["pass@3"] <= 1.0 and m["mean@3"] == m["judge_acc"]
        assert set(m["pass@k_unbiased"]) == {"1", "2", "3"} and m["pass@k_unbiased"]["3"] == m["pass@3"]
    examples = [json.loads(line) for line in (tmp_path / "a/examples.jsonl").read_text().splitlines()]
    assert len(examples) == 2 and res["overall"]["n"] == 2
    for e in examples:
        assert len(e["pred"]) == len(e["judge_correct"]) == len(e["response"]) == len(e["turns"]) == 3
        assert len(set(e["response"])) == 3                  # three draws, not one answer copied
    correct = [c for e in examples for c in e["judge_correct"]]
    assert res["overall"]["mean@3"] == pytest.approx(sum(correct) / 6, abs=1e-4)
    assert res["overall"]["pass@3"] == pytest.approx(sum(any(e["judge_correct"]) for e in examples) / 2)
    md = (tmp_path / "a/results.md").read_text()
    assert "| pass@3 | mean@3 | pass@k unbiased (k=1/2/3) |" in md and "3 samples per question" in md
    assert eval_cli.main(args + ["--out_dir", str(tmp_path / "b")]) == 0
    again = [json.loads(line) for line in (tmp_path / "b/examples.jsonl").read_text().splitlines()]
    assert [e["response"] for e in again] == [e["response"] for e in examples]


def test_evaluate_samples_run_their_own_search_loops(tiny_model_dir):
    """Every sample is its own multi-turn rollout: a search backend sees each sample's queries, and one
    sample's documents never land in another's sequence. A stub engine searches on turn 0, then answers."""
    from inference.evaluate import EvalConfig, evaluate
    from inference.data import EvalRow
    from inference.engine_api import GenOutput
    from inference.rollout import RolloutConfig
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class Stub:
        tokenizer = tok

        def generate(self, prompts, samplings):
            outs = []
            for p, s in zip(prompts, samplings):
                read_docs = tok.decode(p).endswith("</information>\n\n")   # the prompt itself names the tag
                text = "<answer>Paris</answer>" if read_docs else f"<search>q{s.seed}</search>"
                ids = tok(text, add_special_tokens=False)["input_ids"]
                outs.append(GenOutput(ids, [0.0] * len(ids), text, "stop"))
            return outs

    asked: list[str] = []

    def search(queries, topk):
        asked.extend(queries)
        return [[{"id": q, "contents": f"{q}\ndoc for {q}"}] for q in queries]

    rows = [EvalRow("What is the capital of France?", ["Paris"], "a", "1"),
            EvalRow("Who wrote Hamlet?", ["Shakespeare"], "a", "2")]
    cfg = EvalConfig(rollout=RolloutConfig(max_turns=2, max_tokens_per_turn=8, temperature=1.0, seed=3),
                     samples=4, batch_size=5, progress=False)   # 5 // 4 = one question per rollout call
    res = evaluate(Stub(), rows, search, cfg)
    questions = [r.question for r in rows]
    assert [q for q in asked if q in questions] == questions  # the question-title baseline: one search per question
    asked = [q for q in asked if q not in questions]
    assert len(asked) == 8 and len(set(asked[:4])) == 4     # 2 questions x 4 samples, distinct seeds per question
    for e in res["examples"]:
        assert e["searches"] == [1] * 4 and e["turns"] == [2] * 4 and len(set(map(tuple, e["queries"]))) == 4
        assert e["doc_titles"] == [[[q]] for (q,) in e["queries"]] and e["question_title_em"] is False
        for (q,), resp in zip(e["queries"], e["response"]):
            assert resp.count("doc for") == 1 and f"doc for {q}" in resp
    assert res["overall"]["question_title_em"] == 0.0 and res["overall"]["searches_hist"] == {"1": 1.0}
    assert e["pred"] == ["Paris"] * 4 and res["examples"][0]["judge_correct"] == [True] * 4
    assert res["overall"]["pass@4"] == 0.5 and res["overall"]["mean@4"] == 0.5
    assert res["per_source"]["a"]["pass@k_unbiased"] == {"1": 0.5, "2": 0.5, "4": 0.5}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_samples_vllm_draws_differ(tiny_model_dir, tmp_path):
    """The vLLM path: per-request seeds reach vLLM, so the 3 samples of a question are 3 different draws."""
    out = tmp_path / "ev"
    cmd = [sys.executable, "eval.py", "--model", str(tiny_model_dir), "--data", EVAL_SETS[0], "--limit", "2",
           "--max_turns", "1", "--max_tokens_per_turn", "12", "--max_total_tokens", "1024", "--max_model_len", "1024",
           "--samples", "3", "--temperature", "1.0", "--out_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    examples = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert len(examples) == 2 and all(len(set(e["response"])) == 3 for e in examples)
    m = json.loads((out / "results.json").read_text())["overall"]
    assert 0.0 <= m["mean@3"] <= m["pass@3"] <= 1.0
