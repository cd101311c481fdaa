"""eval.py end to end: the real CLI on a slice of the bundled sets, with a real BM25 index; and the
in-process path the trainer reuses (`evaluate`), checked against a recomputation from its examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EVAL_SETS = ["data/eval/capitals.jsonl", "data/eval/fanoutqa_singlehop.jsonl"]
PROTOCOL_KEYS = ("model", "engine", "retriever", "topk", "max_turns", "token_caps", "template", "judge", "sampling", "examples")


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
    md = (out / "results.md").read_text()
    assert md.index("## Protocol") < md.index("## Results")
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
    from eval import EvalConfig, evaluate
    from inference.data import EvalRow
    from inference.engines import HFEngine
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


def test_cli_refuses_bad_flags(tmp_path, capsys):
    import eval as eval_cli

    base = ["--model", "m", "--data", "d.jsonl", "--out_dir", str(tmp_path)]
    for extra, msg in ((["--index", "i", "--retriever_url", "http://x"], "choose one search backend"),
                       (["--self_search", "--simulated"], "got --self_search and --simulated"),
                       (["--sim_url", "http://x"], "--simulated, which is not set"),
                       (["--limit", "0"], "--limit must be >= 1"),
                       (["--index", str(tmp_path / "nope")], "is not a built index"),
                       (["--max_total_tokens", "9000"], "exceeds --max_model_len")):
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
