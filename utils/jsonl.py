"""The one JSONL reader: rows of a one-object-a-line file, streamed, each with what is wrong with it.

Shared by the row readers (inference/data.py) and the corpus reader (retrieval/corpus.py), so both
say the same things about a bad line: which byte is not UTF-8 (and how to convert the file), or why
a line is not JSON. A leading UTF-8 byte-order mark is accepted; blank lines are skipped. Whether a
row must be a JSON object is the caller's rule (each names the problem its own way).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def not_utf8(path: str | os.PathLike, byte: int, offset: int, e: UnicodeDecodeError) -> str:
    """What to say about `byte`, at byte `offset` of the file, that is not UTF-8."""
    path = Path(path)
    return (f"byte 0x{byte:02x} at byte offset {offset} of the file is not UTF-8 ({e.reason}); the file "
            f"must be UTF-8: convert it, e.g. `iconv -f latin1 -t utf-8 {path} > fixed{path.suffix}`")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any, str | None]]:
    """(lineno, value, problem) for every non-blank line, 1-based, streamed (a corpus may not fit in memory).

    A line that is not UTF-8 or not JSON comes as (lineno, None, what is wrong) and the rest still follow;
    the caller decides whether to stop at the first one.
    """
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, not_utf8(path, raw[e.start], start + e.start, e)
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, None, f"not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON object"
                continue
            yield lineno, value, None
