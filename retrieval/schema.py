"""Search-R1's `/retrieve` wire format, its validation, and its conversion to our doc dicts.

Request : {"queries": ["..", ..], "topk": 3, "return_scores": true}
Response: return_scores true  -> {"result": [[{"document": {"id", "contents"}, "score": s}, ..], ..]}
          return_scores false -> {"result": [[{"id", "contents"}, ..], ..]}      (Search-R1 does the same)

As in Search-R1, a missing or null topk means the server's default, return_scores defaults to
false, unknown keys are ignored, and an empty `queries` list gets {"result": []} (its trainer
sends one on a step where no rollout searched). Unlike Search-R1 (which answers bad input with a
500 or a pydantic dump), every bad request gets a 4xx whose "detail" names the field and the limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    # Per request. Search-R1's trainer sends all searches of a step in one request (512 prompts x
    # 5 samples = 2,560); our client splits at whatever /health reports.
    max_queries: int = 4096
    max_query_chars: int = 4096     # a search query is a sentence; 4k chars is far past any real one
    max_topk: int = 100
    default_topk: int = 3           # Search-R1's default
    max_body_bytes: int = 16 << 20  # that 2,560-query step fits even at 4k chars per query (10.5 MB)


class RequestError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def _show(value) -> str:
    """A bad value for an error message: short, and safe for any nesting depth (no repr/dumps of containers)."""
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


def parse_retrieve_request(body: bytes, limits: Limits) -> RetrieveRequest:
    """Validate a raw /retrieve body; raise RequestError(4xx, message) on anything wrong."""
    if len(body) > limits.max_body_bytes:
        raise RequestError(413, f"request body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"malformed JSON body: {e}") from None
    except RecursionError:  # json's C parser recurses per [ or {; without this, 100k of them were a 500
        raise RequestError(400, "JSON body is nested too deeply; send {\"queries\": [\"...\"], \"topk\": 3}") from None
    if not isinstance(data, dict):
        raise RequestError(422, f"body must be a JSON object with 'queries', got {type(data).__name__}")
    if "queries" not in data:
        raise RequestError(422, "missing field 'queries' (a list of query strings)")
    queries = data["queries"]
    if not isinstance(queries, list):
        raise RequestError(422, f"'queries' must be a list of strings, got {type(queries).__name__}")
    if len(queries) > limits.max_queries:
        raise RequestError(422, f"'queries' holds {len(queries)} queries; the limit is {limits.max_queries} per request "
                                "(GET /health reports it as max_queries): split them over several requests")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(422, f"queries[{i}] is {type(q).__name__}, not a string")
        if not q.strip():
            raise RequestError(422, f"queries[{i}] is empty or whitespace")
        if len(q) > limits.max_query_chars:
            raise RequestError(422, f"queries[{i}] is {len(q)} characters; the limit is {limits.max_query_chars}")
        try:  # JSON lets "\ud800" through; it is no text, and the encoder's tokenizer cannot take it
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(422, f"queries[{i}] holds a lone surrogate ({ascii(q[e.start])} at character "
                                    f"{e.start}); send valid Unicode (a \\ud800-\\udbff escape must be followed "
                                    "by a \\udc00-\\udfff one)") from None
    topk = data.get("topk")
    if topk is None:
        topk = limits.default_topk
    elif isinstance(topk, bool) or not isinstance(topk, int):
        raise RequestError(422, f"'topk' must be an integer, got {_show(topk)}")
    elif not 1 <= topk <= limits.max_topk:
        raise RequestError(422, f"'topk' is {topk}; it must be between 1 and {limits.max_topk}")
    rs = data.get("return_scores", False)
    if not isinstance(rs, bool):
        raise RequestError(422, f"'return_scores' must be true or false, got {_show(rs)}")
    return RetrieveRequest(queries, topk, rs)


def format_result(docs: list[list[dict]], return_scores: bool) -> dict:
    """Our [[{"id", "contents", "score"}]] -> Search-R1's response body."""
    if return_scores:
        return {"result": [[{"document": {"id": d["id"], "contents": d["contents"]}, "score": d["score"]} for d in row]
                           for row in docs]}
    return {"result": [[{"id": d["id"], "contents": d["contents"]} for d in row] for row in docs]}


def parse_result(payload: dict, n_queries: int) -> list[list[dict]]:
    """A /retrieve response (ours or Search-R1's, scores or not) -> [[{"id", "contents", "score"}]]."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ValueError(f"response has no 'result' list: {str(payload)[:200]}")
    rows = payload["result"]
    if len(rows) != n_queries:
        raise ValueError(f"response holds {len(rows)} result lists for {n_queries} queries")
    out = []
    for row in rows:
        docs = []
        for item in row:
            doc, score = (item["document"], item.get("score")) if "document" in item else (item, None)
            contents = doc.get("contents")
            if contents is None:  # FlashRAG rows may carry title/text instead of contents
                contents = f"{doc.get('title', '')}\n{doc.get('text', '')}"
            docs.append({"id": str(doc.get("id", "")), "contents": contents,
                         "score": float(score) if score is not None else 0.0})
        out.append(docs)
    return out
