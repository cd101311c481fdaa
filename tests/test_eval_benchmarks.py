"""eval.py on the benchmarks papers report (issue 42): a folder in Search-R1's / FlashRAG's layout, an
OpenAI-compatible judge, and one table row per benchmark in SSP's Table 1 order with EM, the judge's accuracy and
their average, each number checked against a plain recomputation from examples.jsonl.

The stand-ins are written here: FlashRAG's nq/test.jsonl (no data_source: the folder names it) beside a
nq/train.jsonl that must never be read, hotpotqa/dev.jsonl (no test split), and Search-R1's merged test.parquet
(data_source per row, the question only in the prompt, the answers only in reward_model) holding popqa and a set no
paper names. The tiny model of the fixtures is loaded (the HF engine, on CPU), and its generate answers from a
script so EM and the judge disagree on known rows; the judge is a small OpenAI-compatible server in a thread
that says yes to one paraphrase.
"""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from tests.json_server import JSONHandler

import pytest

# question -> the answer the scripted policy gives; golden answers are in the rows below
ANSWERS = {"Capital of France?": "Paris", "Who was US president in 2010?": "President Obama",
           "Capital of Japan?": "Osaka", "Which band sang Waterloo?": "ABBA", "Who wrote Hamlet?": "Marlowe",
           "Which river flows through Vienna?": "Danube", "Largest planet?": "Jupiter", "Tallest mountain?": "K2"}
PARAPHRASES = {"President Obama"}   # the judge's only yes beyond exact match


def write_layout(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl(root / "nq/test.jsonl", [  # FlashRAG: id, question, golden_answers, metadata
        {"id": "test_0", "question": "Capital of France?", "golden_answers": ["Paris"], "metadata": {}},
        {"id": "test_1", "question": "Who was US president in 2010?", "golden_answers": ["Barack Obama"], "metadata": {}},
        {"id": "test_2", "question": "Capital of Japan?", "golden_answers": ["Tokyo"], "metadata": {}}])
    jsonl(root / "nq/train.jsonl", [{"id": "train_0", "question": "LEAK", "golden_answers": ["x"]}])
    jsonl(root / "hotpotqa/dev.jsonl", [
        {"id": "dev_0", "question": "Who wrote Hamlet?", "golden_answers": ["William Shakespeare", "Shakespeare"],
         "metadata": {"type": "bridge"}},
        {"id": "dev_1", "question": "Which river flows through Vienna?", "golden_answers": ["Danube"], "metadata": {}}])
    prefix = "Answer the given question. ... Question: "

    def searchr1(i: int, src: str, q: str, golden: list[str]) -> dict:
        return {"data_source": src, "prompt": [{"role": "user", "content": prefix + q + "\n"}], "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": golden}},
                "extra_info": {"split": "test", "index": i}}

    pq.write_table(pa.Table.from_pylist([searchr1(0, "popqa", "Which band sang Waterloo?", ["ABBA"]),
                                         searchr1(1, "my_set", "Tallest mountain?", ["Mount Everest", "Everest"]),
                                         searchr1(2, "popqa", "Largest planet?", ["Saturn"])]), root / "test.parquet")
    return root


class _Judge(JSONHandler):
    asked: list[str] = []


    def do_GET(self) -> None:
        self._reply({"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = body["messages"][-1]["content"]
        answer = user.split("Candidate answer: ", 1)[1].split("\n", 1)[0]
        type(self).asked.append(answer)
        reply = "yes" if answer in PARAPHRASES else "no"
        self._reply({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]})


@pytest.fixture
def judge_url():
    _Judge.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def scripted_policy(monkeypatch):
    """HFEngine.generate answers each question from ANSWERS (the model itself is loaded, never sampled)."""
    from inference import hf_engine
    from inference.engine_api import GenOutput

    def generate(self, prompts, sampling):
        outs = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            q = next(q for q in ANSWERS if q in text)
            reply = f"<answer>{ANSWERS[q]}</answer>"
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            outs.append(GenOutput(ids, [0.0] * len(ids), reply, "stop"))
        return outs

    monkeypatch.setattr(hf_engine.HFEngine, "generate", generate)


def recompute(examples: list[dict], key: str) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for e in examples:
        by.setdefault(e["data_source"], []).append(float(e[key]))
    return {src: sum(v) / len(v) for src, v in by.items()}


@pytest.mark.timeout(300)
def test_benchmark_folder_with_a_judge_one_row_per_benchmark(tiny_model_dir, tmp_path, judge_url, scripted_policy):
    import eval as eval_cli

    bench, out = write_layout(tmp_path / "benchmarks"), tmp_path / "ev"
    rc = eval_cli.main(["--model", str(tiny_model_dir), "--engine", "hf", "--data", str(bench), "--max_turns", "1",
                        "--max_tokens_per_turn", "16", "--judge_url", judge_url, "--judge_model", "judge",
                        "--out_dir", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    examples = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    # the folder's eval files: test.parquet, nq's test split (not train), hotpotqa's dev split
    assert res["protocol"]["examples"] == (f"8 from {bench / 'test.parquet'}, {bench / 'hotpotqa/dev.jsonl'}, "
                                           f"{bench / 'nq/test.jsonl'}")
    assert "LEAK" not in {e["question"] for e in examples}
    assert {e["data_source"] for e in examples} == {"nq", "hotpotqa", "popqa", "my_set"}
    # the judge was asked about the misses only, and said yes to the paraphrase
    assert sorted(_Judge.asked) == sorted(["President Obama", "Osaka", "Marlowe", "Jupiter", "K2"])

    table = res["benchmarks"]
    assert table["judge"] == "llm"
    assert [(r["benchmark"], r["data_source"]) for r in table["rows"]] == [
        ("NQ", "nq"), ("PopQA", "popqa"), ("HotpotQA", "hotpotqa"), ("my_set", "my_set")]
    em, acc = recompute(examples, "em"), recompute(examples, "judge_correct")
    n = {src: sum(e["data_source"] == src for e in examples) for src in em}
    for r in table["rows"]:
        src = r["data_source"]
        assert r["n"] == n[src]
        assert r["em"] == pytest.approx(em[src], abs=1e-4) and r["judge_acc"] == pytest.approx(acc[src], abs=1e-4)
    # by hand: NQ 1/3 EM, 2/3 judged; PopQA 1/2 both; HotpotQA 1/2 both; my_set 0
    assert [(r["em"], r["judge_acc"]) for r in table["rows"]] == [
        (pytest.approx(1 / 3, abs=1e-4), pytest.approx(2 / 3, abs=1e-4)), (0.5, 0.5), (0.5, 0.5), (0.0, 0.0)]
    avg = table["average"]   # unweighted over the benchmarks, as SSP's Table 1 (not the pooled overall)
    assert avg["benchmarks"] == 4 and avg["n"] == 8
    assert avg["em"] == pytest.approx(sum(em.values()) / 4, abs=1e-4)
    assert avg["judge_acc"] == pytest.approx(sum(acc.values()) / 4, abs=1e-4)
    assert avg["judge_acc"] != pytest.approx(res["overall"]["judge_acc"], abs=1e-3)   # 5/12 against the pooled 4/8

    md = (out / "results.md").read_text()
    section = md.split("## Benchmarks", 1)[1].split("## Title heuristic", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == "| benchmark | data_source | n | EM | LLM judge acc |"
    assert lines[1:] == ["| NQ | nq | 3 | 0.333 | 0.667 |", "| PopQA | popqa | 2 | 0.500 | 0.500 |",
                         "| HotpotQA | hotpotqa | 2 | 0.500 | 0.500 |", "| my_set | my_set | 1 | 0.000 | 0.000 |",
                         f"| **Average** | 4 benchmarks | 8 | {avg['em']:.3f} | {avg['judge_acc']:.3f} |"]

    # without a judge the judge column is blank ("-"), and the average is EM's alone
    rc = eval_cli.main(["--model", str(tiny_model_dir), "--engine", "hf", "--data", str(bench / "nq"), "--max_turns",
                        "1", "--max_tokens_per_turn", "16", "--out_dir", str(tmp_path / "ev_em")])
    assert rc == 0
    plain = json.loads((tmp_path / "ev_em/results.json").read_text())["benchmarks"]
    assert plain["judge"] == "none" and [r["judge_acc"] for r in plain["rows"]] == [None]
    assert plain["average"]["judge_acc"] is None and plain["average"]["em"] == pytest.approx(1 / 3, abs=1e-4)
    assert "| NQ | nq | 3 | 0.333 | - |" in (tmp_path / "ev_em/results.md").read_text()


def test_eval_files_picks_the_eval_split_and_names_the_benchmark(tmp_path):
    """A folder's own row files and its subfolders' (one level), test before dev, never train; a FlashRAG row takes
    its folder's name; a folder with nothing to read is refused naming the layouts."""
    from inference.benchmarks import benchmark_name, eval_files
    from inference.data import RowError, load_eval_rows

    root = write_layout(tmp_path / "b")
    (root / "nq/dev.jsonl").write_text((root / "nq/test.jsonl").read_text())
    (root / "bamboogle.jsonl").write_text('{"question": "q?", "golden_answers": ["a"]}\n')
    (root / "notes").mkdir()
    (root / "notes" / "about.txt").write_text("not rows\n")
    assert eval_files(root) == [str(root / "bamboogle.jsonl"), str(root / "test.parquet"),
                                str(root / "hotpotqa/dev.jsonl"), str(root / "nq/test.jsonl")]
    assert eval_files(root / "nq/dev.jsonl") == [str(root / "nq/dev.jsonl")]   # a file named on purpose is read
    assert {r.data_source for r in load_eval_rows(root / "nq/test.jsonl")} == {"nq"}
    assert {r.data_source for r in load_eval_rows(root / "bamboogle.jsonl")} == {"bamboogle"}
    assert [benchmark_name(s)[1] for s in ("nq", "2wikimultihopqa", "MuSiQue", "trivia_qa", "bamboogle", "x")] == [
        "NQ", "2Wiki", "MuSiQue", "TriviaQA", "Bamboogle", "x"]
    with pytest.raises(RowError, match=r"notes is a folder with no eval files: expected <benchmark>/test.jsonl"):
        eval_files(root / "notes")


def test_eval_cli_refuses_an_empty_benchmark_folder(tmp_path, capsys, smollm2_dir):
    import eval as eval_cli

    (tmp_path / "empty/nq").mkdir(parents=True)
    (tmp_path / "empty/nq/train.jsonl").write_text('{"question": "q?", "golden_answers": ["a"]}\n')
    rc = eval_cli.main(["--model", str(smollm2_dir), "--data", str(tmp_path / "empty"), "--out_dir", str(tmp_path / "ev")])
    assert rc != 0
    assert f"--data {tmp_path / 'empty'} is a folder with no eval files" in capsys.readouterr().err
