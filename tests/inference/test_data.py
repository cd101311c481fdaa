"""Row loaders: our JSONL, SSP's released proposer rows, Search-R1 eval/train rows; JSONL and parquet. And the
search-count mix (--search_turns_mix) drawn over proposer rows."""

from __future__ import annotations

import json
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
    with pytest.raises(RowError, match=r"bad\.jsonl: row 1 has no ground-truth answer .*'title'"):
        load_proposer_rows(p)
    p = write_jsonl(tmp_path / "nocount.jsonl", [{"answer": "x"}])
    with pytest.raises(RowError, match=r"nocount\.jsonl: row 0 has no search count.*default_search_turns"):
        load_proposer_rows(p)
    assert load_proposer_rows(p, default_search_turns=2)[0].search_turns == 2
    (tmp_path / "broken.jsonl").write_text('{"answer": "x", "search_turns": 1}\n{oops\n')
    with pytest.raises(RowError, match=r"broken\.jsonl:2: not valid JSON"):
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
    with pytest.raises(RowError, match=r"noq\.jsonl: row 0 has no question"):
        load_eval_rows(p)
    p = write_jsonl(tmp_path / "nog.jsonl", [{"question": "q?", "golden_answers": []}])
    with pytest.raises(RowError, match=r"nog\.jsonl: row 0 has no golden answers"):
        load_eval_rows(p)


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
