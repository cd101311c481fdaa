"""Baseline for bench_retrieval.py: the per-request retrieval server most search-RL projects ship.

Like Search-R1's retrieval_server.py: a FastAPI *sync* endpoint, so each request runs on its own
in Starlette's thread pool and does its own encoder forward pass and FAISS search, whatever else
is in flight. Same index, encoder and response schema as retrieval.server; only the request
handling differs (no micro-batching). Not for production use: no input limits.

    python bench/baseline_server.py --index data/indexes/minilm_flat --port 8001
"""
# No `from __future__ import annotations` here: FastAPI must resolve the local QueryRequest annotation.

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from retrieval.schema import format_result  # noqa: E402


def make_app(retriever, default_topk: int = 3):
    from fastapi import FastAPI
    from pydantic import BaseModel

    class QueryRequest(BaseModel):
        queries: List[str]
        topk: Optional[int] = None
        return_scores: bool = False

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok", **retriever.describe()}

    @app.post("/retrieve")
    def retrieve(req: QueryRequest):  # sync: one thread-pool worker per request, one encode per request
        return format_result(retriever.search(req.queries, req.topk or default_topk), req.return_scores)

    return app


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="index folder made by retrieval.build_index")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8001, help="TCP port")
    p.add_argument("--threads", type=int, default=None, help="torch/FAISS CPU threads (default: library default)")
    a = p.parse_args(argv)

    import uvicorn

    if a.threads:  # same thread setting as retrieval.server --threads
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        import torch
        torch.set_num_threads(a.threads)
    from retrieval.retriever import load_retriever

    # Loaded before the port opens, as in Search-R1.
    uvicorn.run(make_app(load_retriever(a.index)), host=a.host, port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
