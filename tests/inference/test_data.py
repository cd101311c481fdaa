"""Row loaders: our JSONL, SSP's released proposer rows, Search-R1 eval/train rows; JSONL and parquet. And the
search-count mix (--search_turns_mix) drawn over proposer rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inference.data import (ProposerRow, RowError, draw_search_turns, load_eval_rows, load_proposer_rows,
                            mix_search_turns, parse_search_turns_mix)

REPO = Path(__file__).resolve().parents[2]

SSP_USER = ("The answer I provided is: {}\nYou need to create a question that requires {} searches.\n"
            "When you have enough information to construct a question, ...")


def ssp_processed(answer, n, with_turns_field=False):
    # The shape SSP's examples/data_preprocess/preprocess_ssp_train_dataset.py writes (verl style).
    row = {
        "data_source": "quark_selfplay_en",
        "prompt": [{"content": "You are an expert question creator.", "role": "system"},
                   {"content": SSP_USER.format(answer, n), "role": "user"}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": answer}, "style": "rule"},
        "extra_info": {"index": 0, "need_tools_kwargs": True, "question": "dummy", "split": "train"},
    }
    if with_turns_field:
        row["extra_info"]["search_turns"] = n
    return row


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_proposer_ours(tmp_path, writer, suffix):
    rows = [{"answer": "Paris", "search_turns": 2, "data_source": "wiki"},
            {"answer": "Seine", "search_turns": 3, "data_source": "wiki"}]
    got = load_proposer_rows(writer(tmp_path / f"p{suffix}", rows))
    assert [(r.answer, r.search_turns, r.data_source) for r in got] == [("Paris", 2, "wiki"), ("Seine", 3, "wiki")]


def test_proposer_ssp_raw_and_list_answers(tmp_path):
    rows = [{"ground_truth": "Kyoto", "search_turns": 4, "sys_question_example": "..."},
            {"ground_truth": ["Kyoto", "Kyōto"], "search_turns": "2"}]
    got = load_proposer_rows(write_jsonl(tmp_path / "raw.jsonl", rows))
    assert got[0].answer == "Kyoto" and got[0].search_turns == 4
    assert got[1].answer == ["Kyoto", "Kyōto"] and got[1].search_turns == 2


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_proposer_ssp_processed(tmp_path, writer, suffix):
    # count only in the prompt text
    got = load_proposer_rows(writer(tmp_path / f"a{suffix}", [ssp_processed("Mount Fuji", 3)]))
    assert got[0].answer == "Mount Fuji" and got[0].search_turns == 3
    assert got[0].data_source == "quark_selfplay_en"
    # an explicit extra_info.search_turns wins over the prompt text
    row = ssp_processed("Mount Fuji", 3, with_turns_field=True)
    row["extra_info"]["search_turns"] = 5
    got = load_proposer_rows(writer(tmp_path / f"b{suffix}", [row]))
    assert got[0].search_turns == 5
    # list-valued target
    got = load_proposer_rows(writer(tmp_path / f"c{suffix}", [ssp_processed(["Fuji", "Mount Fuji"], 2)]))
    assert got[0].answer == ["Fuji", "Mount Fuji"]


def test_proposer_errors_name_file_and_field(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"answer": "x", "search_turns": 1}, {"title": "no answer"}])
    with pytest.raises(RowError, match=r"bad\.jsonl: line 2: no ground-truth answer .*'title'"):
        load_proposer_rows(p)
    p = write_jsonl(tmp_path / "nocount.jsonl", [{"answer": "x"}])
    with pytest.raises(RowError, match=r"nocount\.jsonl: line 1: no search count.*search_turns field"):
        load_proposer_rows(p)
    assert load_proposer_rows(p, default_search_turns=2)[0].search_turns == 2
    (tmp_path / "broken.jsonl").write_text('{"answer": "x", "search_turns": 1}\n{oops\n')
    with pytest.raises(RowError, match=r"broken\.jsonl: line 2: not valid JSON"):
        load_proposer_rows(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_proposer_rows(tmp_path / "nope.jsonl")
    with pytest.raises(RowError, match="unknown row file type"):
        load_proposer_rows(write_jsonl(tmp_path / "x.csv", []))


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_eval_rows_flat(tmp_path, writer, suffix):
    rows = [{"id": "a", "question": "Capital of France?", "golden_answers": ["Paris"], "data_source": "nq"},
            {"id": "b", "question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare", "W. Shakespeare"],
             "data_source": "hotpotqa"}]
    got = load_eval_rows(writer(tmp_path / f"e{suffix}", rows))
    assert [(r.id, r.question, r.golden_answers, r.data_source) for r in got] == [
        ("a", "Capital of France?", ["Paris"], "nq"),
        ("b", "Who wrote Hamlet?", ["Shakespeare", "W. Shakespeare"], "hotpotqa"),
    ]
    assert len(load_eval_rows(tmp_path / f"e{suffix}", limit=1)) == 1


def test_eval_rows_search_r1_train_parquet(tmp_path):
    # Search-R1's train parquet: the golden answers only in reward_model.ground_truth.target, question in the prompt
    prefix = "Answer the given question. ... For example, <answer> Beijing </answer>. Question: "
    rows = [{"data_source": "nq", "prompt": [{"role": "user", "content": prefix + "who sang waterloo?\n"}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["ABBA"]}},
             "extra_info": {"split": "train", "index": 7}}]
    got = load_eval_rows(write_parquet(tmp_path / "train.parquet", rows))
    assert (got[0].question, got[0].golden_answers, got[0].data_source, got[0].id) == ("who sang waterloo?", ["ABBA"], "nq", "7")


def test_eval_rows_defaults_and_errors(tmp_path):
    p = write_jsonl(tmp_path / "mysrc.jsonl", [{"question": "q?", "golden_answers": "single"}])
    r = load_eval_rows(p)[0]
    assert r.golden_answers == ["single"] and r.data_source == "mysrc" and r.id == "0"
    p = write_jsonl(tmp_path / "noq.jsonl", [{"golden_answers": ["x"]}])
    with pytest.raises(RowError, match=r"noq\.jsonl: line 1: no question"):
        load_eval_rows(p)
    p = write_jsonl(tmp_path / "nog.jsonl", [{"question": "q?", "golden_answers": []}])
    with pytest.raises(RowError, match=r"nog\.jsonl: line 1: no golden answers"):
        load_eval_rows(p)


# ---- answers in the shapes QA exports give them (issue 33): read as their text, or refused by shape

@pytest.mark.parametrize("value, texts", [
    ("Paris", ["Paris"]),
    (["Paris", "paris", "Paris"], ["Paris", "paris"]),
    ([{"text": "Paris", "answer_start": 17}, {"text": "City of Paris", "answer_start": 3}], ["Paris", "City of Paris"]),  # SQuAD / NQ
    ({"text": ["Paris", "Paris"], "answer_start": [17, 40]}, ["Paris"]),                                   # HF squad
    ({"value": "Paris", "aliases": ["Paris", "City of Light"], "normalized_value": "paris"}, ["Paris", "City of Light"]),  # TriviaQA
    ({"target": ["ABBA"]}, ["ABBA"]),                                                                       # verl
    (1969, ["1969"]), (1969.0, ["1969"]), (2.5, ["2.5"]), ([["a", "b"], "c"], ["a", "b", "c"]), ([], []), (None, []),
])
def test_answer_texts_reads_every_common_shape(value, texts):
    from inference.data import answer_texts
    assert answer_texts(value) == texts


@pytest.mark.parametrize("value, shape", [
    (True, "a boolean (true)"),
    ({"answer_start": 3}, "an object with keys ['answer_start']"),
    ([{"span": "Paris"}], "a list of objects with keys ['span']"),
    ([1, {"x": 2}], "a list mixing numbers and objects with keys ['x']"),
])
def test_answer_texts_refuses_other_shapes_by_name(value, shape):
    from inference.data import ShapeError, answer_texts
    with pytest.raises(ShapeError, match=re.escape(shape)):
        answer_texts(value)


@pytest.mark.parametrize("writer, suffix, where", [(write_jsonl, ".jsonl", "line 2"), (write_parquet, ".parquet", "row 2")])
def test_squad_answers_are_their_text_in_every_loader(tmp_path, writer, suffix, where):
    squad = [{"text": "Paris", "answer_start": 17}]
    got = load_eval_rows(writer(tmp_path / f"e{suffix}", [{"question": "Capital of France?", "answers": squad}]))
    assert got[0].golden_answers == ["Paris"]                    # it was "{'text': 'Paris', 'answer_start': 17}"
    got = load_proposer_rows(writer(tmp_path / f"p{suffix}", [{"answer": squad, "search_turns": 2}]))
    assert got[0].answer == ["Paris"]
    bad = [{"question": "q1", "answers": [{"span": 0}]}, {"question": "q2", "answers": [{"span": 1}]}]
    with pytest.raises(RowError, match=rf"b{re.escape(suffix)}: 2 rows cannot be read(.|\n)*{where}: field 'answers' is "
                                       rf"a list of objects with keys \['span'\]"):
        load_eval_rows(writer(tmp_path / f"b{suffix}", bad))


def test_every_bad_row_of_a_file_is_found_in_one_pass(tmp_path):
    p = tmp_path / "many.jsonl"
    good = json.dumps({"question": "q", "golden_answers": ["a"]})
    p.write_bytes("\n".join([good, "{oops", good, json.dumps({"question": "q"})] + ["[1]"] * 6).encode() + b"\n"
                  + b'{"question": "caf\xe9", "golden_answers": ["x"]}\n')
    with pytest.raises(RowError) as e:
        load_eval_rows(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: 9 rows cannot be read (the first 5 shown):") and msg.count("\n    line ") == 5
    assert "line 2: not valid JSON" in msg and "line 4: no golden answers" in msg and "line 5: a list" in msg
    # a non-UTF-8 byte names its line and byte offset (it was a bare UnicodeDecodeError)
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + b"\n" + '{"question": "café", "golden_answers": ["x"]}'.encode("latin-1"))
    at = len(good) + 1 + len('{"question": "caf')
    with pytest.raises(RowError, match=rf"latin1\.jsonl: line 2: byte 0xe9 at byte offset {at} of the file is not UTF-8"):
        load_eval_rows(tmp_path / "latin1.jsonl")
    # a JSON array counts items from 1; a search count of the wrong shape is named
    (tmp_path / "arr.json").write_text(json.dumps([{"answer": "x", "search_turns": 2}, {"answer": "y", "search_turns": "two"}]))
    with pytest.raises(RowError, match=r"arr\.json: item 2: field 'search_turns' is text \('two'\); expected a whole number"):
        load_proposer_rows(tmp_path / "arr.json")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(RowError, match="no rows"):
        load_proposer_rows(tmp_path / "empty.jsonl")


def test_bundled_files_load():
    # the files scripts/prepare_data.py writes (skip-free: they are made by the test entry script)
    rows = load_proposer_rows(REPO / "data/train/proposer.jsonl")
    assert len(rows) > 100 and all(r.search_turns >= 1 and r.answer for r in rows)
    for name in ("capitals", "fanoutqa_multihop", "fanoutqa_singlehop"):
        ev = load_eval_rows(REPO / f"data/eval/{name}.jsonl")
        assert ev and all(r.question and r.golden_answers for r in ev)


def test_the_search_count_mix_follows_its_weights_and_replays_by_position():
    w = parse_search_turns_mix("4:3:2:1")
    assert w == [4.0, 3.0, 2.0, 1.0] and parse_search_turns_mix("") == [] and parse_search_turns_mix(" ") == []
    n = 20_000
    draws = [draw_search_turns(w, 42, pos) for pos in range(n)]
    for k, wk in enumerate(w, start=1):
        p = wk / sum(w)
        # 6 standard deviations of a binomial count: a fair draw leaves this once in ~5e8 seeds; the seed is fixed
        assert abs(draws.count(k) - n * p) < 6 * (n * p * (1 - p)) ** 0.5, (k, draws.count(k), n * p)
    assert set(draws) == {1, 2, 3, 4}
    assert draws[:200] == [draw_search_turns(w, 42, pos) for pos in range(200)]        # same seed and position
    assert draws[:200] != [draw_search_turns(w, 43, pos) for pos in range(200)]        # another seed, other draws
    assert all(draw_search_turns([0, 1, 0], 1, pos) == 2 for pos in range(100))        # a 0 weight is never drawn
    # clamped into [--min_searches, --max_turns - 1]: n = 1 folds into 2, n = 4 into 3
    base = [ProposerRow(answer=f"a{i}", search_turns=2) for i in range(40)]
    rows = mix_search_turns(base, 100, "4:3:2:1", 42, 2, 3)
    drawn = [draw_search_turns(w, 42, 100 + i) for i in range(40)]
    assert [r.search_turns for r in rows] == [min(max(d, 2), 3) for d in drawn] and {1, 4} <= set(drawn)
    assert all(r.search_turns == 2 for r in base) and mix_search_turns(base, 0, "", 42, 2, 3) is base  # copies; off
    with pytest.raises(ValueError, match="not all 0"):
        parse_search_turns_mix("0:0")
