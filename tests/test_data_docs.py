"""The data formats docs/data.md documents are the ones the project's readers read (issue 42).

Every ```jsonl block of docs/data.md is read from the markdown, written to a file and read by the reader its
section names: inference/data.py's load_proposer_rows (proposer answer rows, as train.py calls it: no default
search count), load_eval_rows (labelled QA rows, eval sets) and retrieval/corpus.py's iter_corpus (the corpus).
For the first block of each section (the 3-line example) the section's field table is checked against the
reader: a field marked required, taken out of the rows that have it, gets the row refused; a field marked
optional, taken out, leaves the row readable. Change a reader or the doc and this follows.

The README's "Targets met and missed" list states numbers of bench/results.json; the last test checks that
each one is the measured value, so a re-measured target cannot leave the README behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inference.data import RowError, load_eval_rows, load_proposer_rows
from retrieval.corpus import CorpusError, iter_corpus, title_of

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "data.md"

# section heading -> (reader, the section whose field table applies)
READERS = {
    "Proposer answer rows": ("proposer", "Proposer answer rows"),
    "Labelled QA rows": ("qa", "Labelled QA rows"),
    "Eval sets": ("qa", "Labelled QA rows"),
    "The corpus": ("corpus", "The corpus"),
}


def doc_sections() -> dict[str, str]:
    """{'## heading': its text} of docs/data.md."""
    parts = re.split(r"(?m)^## ", DOC.read_text(encoding="utf-8"))
    return {p.split("\n", 1)[0].strip(): p for p in parts[1:]}


def jsonl_blocks(text: str) -> list[list[str]]:
    return [b.strip("\n").split("\n") for b in re.findall(r"(?ms)^```jsonl\n(.*?)^```", text)]


def field_table(text: str) -> dict[str, str]:
    """{field: 'required' | 'optional'} from the section's '| `field` | required | what |' rows."""
    return dict(re.findall(r"(?m)^\| `([\w.]+)` \| (required|optional) \|", text))


def read(kind: str, path: Path) -> list:
    if kind == "proposer":
        return load_proposer_rows(path)
    if kind == "qa":
        return load_eval_rows(path)
    return [(i, c) for ids, texts in iter_corpus(path) for i, c in zip(ids, texts)]


def write(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p


def test_every_section_has_a_three_line_example():
    secs = doc_sections()
    assert set(READERS) <= set(secs), f"docs/data.md lacks sections {set(READERS) - set(secs)}"
    for name in READERS:
        blocks = jsonl_blocks(secs[name])
        assert blocks and len(blocks[0]) == 3, f"{name}: the first ```jsonl block must be a 3-line example"


@pytest.mark.parametrize("section", list(READERS))
def test_examples_parse_with_the_projects_readers(tmp_path, section):
    kind, _ = READERS[section]
    for k, lines in enumerate(jsonl_blocks(doc_sections()[section])):
        rows = [json.loads(line) for line in lines]
        got = read(kind, write(tmp_path, f"{kind}{k}.jsonl", rows))
        assert len(got) == len(rows)
        if kind == "proposer":
            assert all(r.answer and r.search_turns >= 0 for r in got)
        elif kind == "qa":
            assert all(r.question and r.golden_answers and r.data_source for r in got)
        else:
            assert all(doc_id and title_of(contents) and "\n" in contents for doc_id, contents in got)


@pytest.mark.parametrize("section", list(READERS))
def test_required_and_optional_fields_are_what_the_reader_needs(tmp_path, section):
    kind, table_section = READERS[section]
    secs = doc_sections()
    table = field_table(secs[table_section])
    assert "required" in table.values(), f"{table_section}: no field marked required"
    rows = [json.loads(line) for line in jsonl_blocks(secs[section])[0]]
    checked = set()
    for fld, status in table.items():
        for i, row in enumerate(rows):
            if fld not in row:
                continue
            checked.add(fld)
            path = write(tmp_path, f"{kind}_{fld}_{i}.jsonl", [{k: v for k, v in row.items() if k != fld}])
            if status == "required":
                with pytest.raises((RowError, CorpusError)):
                    read(kind, path)
            else:
                assert len(read(kind, path)) == 1, f"{section}: row {i + 1} without optional {fld} is refused"
    assert any(table[f] == "required" for f in checked), f"{section}: the example shows no required field"


# (results.json key, how the README writes it): the numbers of "Targets met and missed"
TARGET_NUMBERS = [
    ("rollout_async.speedup_300ms", "{:.2f}x"), ("rollout_async.speedup_0ms", "{:.2f}x"),
    ("learning.minutes_per_seed", "{:.0f} min"), ("learning_distill.minutes_per_seed", "{:.0f} min"),
    ("retrieval.qps_ratio_32", "{:.2f}x"), ("sync.seconds", "{:.2f} s"),
    ("loss.packed_speedup", "{:.2f}x"), ("loss.logprob_mem_ratio", "{:.3f}"), ("rollout.vllm_over_hf", "{:.2f}x"),
    ("rollout_async.step_speedup", "{:.2f}x"), ("learning_distill.gain_over_ssp", "+{:.2f}"),
    ("rollout_async_gpu_model.speedup_300ms", "{:.2f}x"), ("rollout_async_gpu_model.step_speedup", "{:.2f}x"),
    ("peer_trl.step_speedup", "{:.2f}x"), ("peer_trl.tokens_per_s_ratio", "{:.2f}x"), ("peer_trl.peak_rss_ratio", "{:.2f}x"),
]


def test_readme_targets_are_the_measured_numbers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"(?ms)^## Targets met and missed\n(.*?)(?=^## |\Z)", readme)
    assert m, "README.md has no '## Targets met and missed' section"
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    stale = [f"{key}: {fmt.format(results[key])}" for key, fmt in TARGET_NUMBERS
             if fmt.format(results[key]) not in m.group(1)]
    assert not stale, f"README's targets differ from bench/results.json (re-measured?): {stale}"
