"""Corpus reading and the on-disk document store of an index.

Input corpora are read as users have them:
  * JSONL, one document a line, wiki-18 / FlashRAG style: {"id": "12", "contents": "Title\\ntext"};
    rows with {"title", "text"} instead of "contents" are joined the same way;
  * parquet with the same columns.

Every index folder holds its own copy of the documents as an uncompressed Arrow IPC file
(`docs.arrow`). It is memory-mapped at serve time, so a 21M-passage corpus costs page cache
rather than Python objects, and an index keeps working when the source corpus moves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from utils.errors import InputError
from utils.jsonl import iter_jsonl

DOCS_FILE = "docs.arrow"


class CorpusError(InputError):
    pass


def _row_to_doc(row: dict, n: int, where: str) -> tuple[str, str]:
    if "contents" in row and row["contents"] is not None:
        contents = row["contents"]
    elif "text" in row:
        # FlashRAG also ships {"title", "text"}; contents puts the title on the first line.
        title = row.get("title") or ""
        contents = f"{title}\n{row['text']}" if title else row["text"]
    else:
        raise CorpusError(f"{where}: row has neither 'contents' nor 'text' (keys: {sorted(row)}); "
                          "expected {'id', 'contents': 'Title\\ntext'}")
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: 'contents' must be a string, got {type(contents).__name__}")
    doc_id = row.get("id", row.get("_id", n))
    return str(doc_id), contents


def iter_corpus(path: str | os.PathLike, batch_size: int = 4096) -> Iterator[tuple[list[str], list[str]]]:
    """Yield (ids, contents) batches from a .jsonl / .json-lines or .parquet corpus."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"corpus file {path} does not exist; build it first (e.g. `python scripts/prepare_data.py`)")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path, batch_size)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        yield from _iter_jsonl(path, batch_size)
    else:
        raise CorpusError(f"corpus {path}: unknown extension '{path.suffix}'; use .jsonl or .parquet")


def _iter_jsonl(path: Path, batch_size: int):
    ids, texts = [], []
    n = 0
    for lineno, row, problem in iter_jsonl(path):
        if problem is not None:
            raise CorpusError(f"{path}:{lineno}: {problem}")
        if not isinstance(row, dict):
            raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        i, c = _row_to_doc(row, n, f"{path}:{lineno}")
        ids.append(i)
        texts.append(c)
        n += 1
        if len(ids) == batch_size:
            yield ids, texts
            ids, texts = [], []
    if ids:
        yield ids, texts


def _iter_parquet(path: Path, batch_size: int):
    import pyarrow.parquet as pq

    n = 0
    import pyarrow as pa

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_size)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable parquet file ({e})") from None
    for batch in batches:
        rows = batch.to_pylist()
        out = [_row_to_doc(r, n + k, f"{path} row {n + k + 1}") for k, r in enumerate(rows)]  # rows count from 1
        n += len(rows)
        yield [o[0] for o in out], [o[1] for o in out]


def title_of(contents: str) -> str:
    """The title is the first line of contents (wiki-18 convention); quotes are stripped as Search-R1 does."""
    return contents.split("\n", 1)[0].strip().strip('"')


def write_docs(corpus: str | os.PathLike, out_dir: str | os.PathLike, batch_size: int = 4096) -> int:
    """Copy the corpus into out_dir/docs.arrow (atomically) and return the document count."""
    import pyarrow as pa
    from tqdm import tqdm

    out = Path(out_dir) / DOCS_FILE
    tmp = out.with_suffix(".arrow.tmp")
    schema = pa.schema([("id", pa.string()), ("contents", pa.string())])
    n = 0
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for ids, texts in tqdm(iter_corpus(corpus, batch_size), desc="reading corpus", unit="batch"):
            writer.write_batch(pa.record_batch([pa.array(ids, pa.string()), pa.array(texts, pa.string())], schema=schema))
            n += len(ids)
    if n == 0:
        tmp.unlink(missing_ok=True)
        raise CorpusError(f"corpus {corpus} holds no documents")
    os.replace(tmp, out)
    return n


class DocStore:
    """Row-index -> {"id", "contents"} over a memory-mapped docs.arrow."""

    def __init__(self, index_dir: str | os.PathLike):
        import pyarrow as pa

        path = Path(index_dir) / DOCS_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; rebuild the index with `python -m retrieval.build_index`")
        self._table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        self._ids = self._table.column("id")
        self._contents = self._table.column("contents")

    def __len__(self) -> int:
        return self._table.num_rows

    def get(self, i: int) -> dict:
        i = int(i)
        return {"id": self._ids[i].as_py(), "contents": self._contents[i].as_py()}

    def contents(self, start: int, stop: int) -> list[str]:
        return self._contents.slice(start, stop - start).to_pylist()

    def all_contents(self) -> list[str]:
        return self._contents.to_pylist()
