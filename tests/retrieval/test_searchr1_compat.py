"""Wire compatibility with Search-R1, both directions.

1. Search-R1's client code (search_r1/llm_agent/generation.py: `requests.post(search_url, json=payload).json()`
   with payload {"queries", "topk", "return_scores": True}, then `doc_item['document']['contents']`
   split into title / text) run against OUR server.
2. OUR client run against a minimal re-implementation of Search-R1's server
   (search_r1/search/retrieval_server.py): a FastAPI sync endpoint with the pydantic request
   model {queries: List[str], topk: Optional[int] = None, return_scores: bool = False}, corpus
   rows as documents, and no /health endpoint.
"""

import threading
import time
from typing import List, Optional

import pytest
import requests

from retrieval.client import RetrievalClient

pytestmark = pytest.mark.slow


def searchr1_batch_search(search_url: str, queries: list[str], topk: int) -> dict:
    """What Search-R1's LLMGenerationManager._batch_search sends and reads."""
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    return requests.post(search_url, json=payload).json()


def searchr1_passages2string(retrieval_result: list[dict]) -> str:
    """Search-R1's _passages2string: it reads only document.contents, title on the first line."""
    out = ""
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item["document"]["contents"]
        title, text = content.split("\n")[0], "\n".join(content.split("\n")[1:])
        out += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return out


@pytest.mark.timeout(300)
def test_searchr1_client_against_our_server(dense_server, dense_retriever):
    qs = ["ancient greek philosophy", "abstract art movement"]
    res = searchr1_batch_search(f"{dense_server}/retrieve", qs, 3)["result"]
    want = dense_retriever.search(qs, 3)
    for row, w in zip(res, want):
        text = searchr1_passages2string(row)
        titles = [d["contents"].split("\n")[0] for d in w]
        assert text.startswith(f"Doc 1(Title: {titles[0]}) ")
        assert all(f"Doc {i + 1}(Title: {t}) " in text for i, t in enumerate(titles))
        assert all(isinstance(item["score"], float) for item in row)
    # Search-R1's own request defaults (no topk, no return_scores) work too
    r = requests.post(f"{dense_server}/retrieve", json={"queries": qs[:1]})
    assert r.status_code == 200 and set(r.json()["result"][0][0]) == {"id", "contents"}


@pytest.mark.timeout(300)
def test_searchr1_full_step_in_one_request(bm25_server, bm25_retriever, corpus_rows):
    """Search-R1's trainer sends every search of a step in one request: 512 prompts x 5 samples."""
    assert requests.get(f"{bm25_server}/health").json()["max_queries"] >= 4096
    titles = [r["contents"].split("\n", 1)[0] for r in corpus_rows]
    forms = ["who was {}", "history of {}", "{} facts", "where is {} from", "{}"]
    qs = [forms[i % 5].format(titles[(i // 5) % len(titles)]) + f" {i}" for i in range(512 * 5)]
    res = searchr1_batch_search(f"{bm25_server}/retrieve", qs, 3)["result"]
    assert len(res) == 2560
    want = bm25_retriever.search(qs, 3)
    assert [[item["document"]["id"] for item in row] for row in res] == [[d["id"] for d in w] for w in want]
    assert sum(map(len, res)) > 2000  # real hits, not empty rows


@pytest.mark.timeout(120)
def test_searchr1_step_with_no_searches(bm25_server):
    """When no rollout searched, Search-R1 still posts, with an empty list, and reads response['result']."""
    assert searchr1_batch_search(f"{bm25_server}/retrieve", [], 3) == {"result": []}


@pytest.fixture
def searchr1_style_server(bm25_retriever, helpers):
    """A Search-R1-schema server on a free port (uvicorn in a thread), backed by our BM25 index."""
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel

    class QueryRequest(BaseModel):
        queries: List[str]
        topk: Optional[int] = None
        return_scores: bool = False

    app = FastAPI()

    sizes = []  # queries per request, for the tests

    @app.post("/retrieve")
    def retrieve_endpoint(request: QueryRequest):
        sizes.append(len(request.queries))
        topk = request.topk or 3
        hits = bm25_retriever.search_ids(request.queries, topk)
        docs = [[bm25_retriever.docs.get(i) for i, _ in row] for row in hits]  # corpus rows, like their load_docs
        scores = [[s for _, s in row] for row in hits]
        if request.return_scores:
            return {"result": [[{"document": d, "score": s} for d, s in zip(dr, sr)] for dr, sr in zip(docs, scores)]}
        return {"result": docs}

    port = helpers.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "Search-R1-style server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/retrieve", sizes
    server.should_exit = True
    th.join(10)


@pytest.mark.timeout(120)
def test_our_client_against_a_searchr1_server(searchr1_style_server, bm25_retriever, helpers):
    url, sizes = searchr1_style_server
    # their server has no /health: the start-up check takes its 404 as "up"
    c = RetrievalClient(url, startup_timeout=10)
    qs = ["greek philosophy", "music of the twentieth century", "war"]
    helpers.same(c.search(qs, 4), bm25_retriever.search(qs, 4), tol=1e-6)
    # their 422 (pydantic) for a bad request surfaces as a ValueError, not a retry loop
    with pytest.raises(ValueError, match="HTTP 422"):
        c._post("/retrieve", {"queries": "not a list"})


@pytest.mark.timeout(120)
def test_our_client_splits_for_a_server_that_reports_no_cap(searchr1_style_server, bm25_retriever, helpers):
    """With no max_queries on /health (Search-R1's server, or ours before it reported one), the
    client sends at most 256 queries per request: the cap our server used to have."""
    url, sizes = searchr1_style_server
    qs = [f"{w} {i}" for i, w in enumerate(["greek philosophy", "music", "war", "art history"] * 150)]
    with RetrievalClient(url, startup_timeout=10) as c:
        helpers.same(c.search(qs, 2), bm25_retriever.search(qs, 2), tol=1e-6)
    assert sizes == [256, 256, 88]
