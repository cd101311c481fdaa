"""HTTP retrieval server speaking Search-R1's `POST /retrieve`, with dynamic micro-batching.

    python -m retrieval.server --index data/indexes/minilm_flat --port 8000
    curl -s localhost:8000/retrieve -d '{"queries": ["who wrote hamlet"], "topk": 3, "return_scores": true}'
    # Search-R1's e5_Flat.index + wiki-18.jsonl (after `python -m retrieval.import_searchr1 ... --out /idx/e5_wiki18`),
    # query encoder on GPU 7, the index sharded over GPUs 6 and 7 in float16:
    python -m retrieval.server --index /idx/e5_wiki18 --device cuda:7 --faiss-gpus 6,7 --faiss-fp16

Multi-node training starts one server per node and points that node's ranks at
http://localhost:PORT (scripts/start_retriever.sh).

Layout: the uvicorn event loop parses and validates requests and queues them for the
micro-batcher (retrieval/batcher.py); each batch goes to a search child process
(retrieval/worker.py) holding the encoder and index, so encoding never takes the GIL from the
event loop. A child that dies is replaced; the batch it held fails with a 503 and clients retry.
Any other search error is a 500 whose body carries a reference to the server log, never the
exception's text (it can hold paths and internal state).

The port opens at once and the index loads in the background: /health answers 503
{"status": "loading"} until the index is ready, then 200 with what it serves, so clients
(retrieval.client) wait for it instead of failing. A dense index paired with an encoder that
did not build it is refused before the port opens (exit code 2).

Endpoints: POST /retrieve (schema in retrieval/schema.py), GET /health (also reports the request
limits, e.g. max_queries, so clients can split), GET /status ("ok" when ready; the path verl's
copy of the Search-R1 server offers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from retrieval.batcher import MicroBatcher
from retrieval.manifest import ManifestError, index_file, read_manifest, resolve_encoder
from retrieval.schema import Limits, RequestError, format_result, parse_retrieve_request
from retrieval.worker import SearchProcess, SearchRestarted
from utils.errors import InputError, entry_point_error

log = logging.getLogger("retrieval.server")


async def _read_body(request, limit: int) -> bytes:
    """Read the body but stop as soon as it passes `limit` bytes (a huge body must not be buffered)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise RequestError(413, f"request body is {cl} bytes; the limit is {limit}")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(load_fn: Callable[[], object], limits: Limits = Limits(), max_batch: int = 64,
               max_wait_s: float = 0.05, on_load_error: Callable[[], None] | None = None):
    """A FastAPI app that loads its search engine with `load_fn()` in a background thread.

    load_fn returns anything with `search_mixed(queries, topks) -> docs` and `describe() -> dict`:
    a Retriever (in-process) or a worker.SearchProcess (what main() uses).
    """
    state = {"retriever": None, "error": None, "t0": time.time()}

    def run_batch(queries: list[str], topks: list[int]) -> list[list[dict]]:
        return state["retriever"].search_mixed(queries, topks)

    batcher = MicroBatcher(run_batch, max_batch=max_batch, max_wait_s=max_wait_s)

    def load() -> None:
        try:
            r = load_fn()
            state["retriever"] = r
            log.info("ready: %s, loaded in %.1fs", r.describe(), time.time() - state["t0"])
        except Exception as e:  # surface it on /health and stop the server rather than serve nothing
            log.exception("loading the index failed")
            state["error"] = f"{type(e).__name__}: {e}"
            if on_load_error is not None:
                on_load_error()

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        threading.Thread(target=load, name="index-loader", daemon=True).start()
        yield
        await batcher.stop()
        if hasattr(state["retriever"], "close"):
            state["retriever"].close()

    app = FastAPI(title="retrieval server (Search-R1 /retrieve API)", lifespan=lifespan)
    app.state.server_state = state
    app.state.batcher = batcher

    def not_ready():
        if state["error"]:
            return JSONResponse({"status": "failed", "detail": state["error"]}, status_code=500)
        return JSONResponse({"status": "loading", "detail": "index is still loading; retry shortly"},
                            status_code=503, headers={"Retry-After": "1"})

    @app.get("/health")
    async def health():
        r = state["retriever"]
        if r is None:
            return not_ready()
        return {"status": "ok", **r.describe(), **asdict(limits), "batches": batcher.batches,
                "queries": batcher.queries, "busy_s": round(batcher.busy_s, 3)}

    @app.get("/status")
    async def status():
        return "ok" if state["retriever"] is not None else not_ready()

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            req = parse_retrieve_request(await _read_body(request, limits.max_body_bytes), limits)
        except RequestError as e:
            return JSONResponse({"detail": e.message}, status_code=e.status)
        if not req.queries:  # Search-R1's step with no searches: nothing to wait for, even while loading
            return {"result": []}
        if state["retriever"] is None:
            return not_ready()
        try:
            docs = await batcher.submit(req.queries, req.topk)
        except SearchRestarted as e:  # our own message, and a retry will be served
            return JSONResponse({"detail": str(e)}, status_code=503, headers={"Retry-After": "1"})
        except Exception as e:  # a bug or a broken index, never bad input (that is caught above)
            ref = uuid.uuid4().hex[:12]
            log.error("search failed (ref %s) for %d queries", ref, len(req.queries), exc_info=e)
            return JSONResponse({"detail": f"search failed with an internal error (ref {ref}); the server log has "
                                           "the details. Retry, and report the ref if it persists"}, status_code=500)
        return Response(json.dumps(format_result(docs, req.return_scores)), media_type="application/json")

    return app


def _gpu_ids(spec: str) -> str:
    """argparse type of --faiss-gpus: checks the list now, keeps the text ("all" still means: use the GPUs)."""
    from retrieval.retriever import parse_gpu_ids  # numpy: the server's own process leaves it to the search process

    try:
        parse_gpu_ids(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def load_kwargs(a: argparse.Namespace, manifest: dict) -> dict:
    """load_retriever's arguments for the search process, from the command line."""
    from retrieval.retriever import parse_gpu_ids

    kw = {"index_dir": a.index, "encoder": a.encoder}
    if manifest["kind"] == "dense":
        kw.update(device=a.device, faiss_gpu=a.faiss_gpu or a.faiss_gpus is not None,
                  faiss_gpus=parse_gpu_ids(a.faiss_gpus), faiss_fp16=True if a.faiss_fp16 else None)
    return kw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # what to serve
    p.add_argument("--index", required=True,
                   help="index folder made by retrieval.build_index or retrieval.import_searchr1 (Search-R1's e5_Flat.index)")
    p.add_argument("--encoder", default=None, help="encoder folder for a dense index (default: the one in manifest.json; "
                                                   "another folder is accepted only if it holds the same model)")
    p.add_argument("--device", default="cpu", help="torch device for the query encoder: cpu, cuda, cuda:1")
    p.add_argument("--faiss-gpu", action="store_true",
                   help="shard the FAISS index over every visible GPU (needs faiss-gpu); see --faiss-gpus")
    p.add_argument("--faiss-gpus", "--faiss_gpus", dest="faiss_gpus", default=None, metavar="IDS", type=_gpu_ids,
                   help="shard the FAISS index over these GPUs only, e.g. 0,1 (implies --faiss-gpu; 'all': every "
                        "visible GPU, as --faiss-gpu alone). Ids count the GPUs this process sees: with CUDA_VISIBLE_DEVICES=6,7 they are "
                        "0,1, and setting CUDA_VISIBLE_DEVICES for the server alone is the other way to choose")
    p.add_argument("--faiss-fp16", action="store_true",
                   help="store the GPU shards as float16 (half the GPU memory; Search-R1's --faiss_gpu does this). "
                        "Default: as built (float32, or float16 for a build_index --fp16 index)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch/FAISS CPU threads of the search process (default: library default = all cores)")
    # where
    p.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    # batching
    p.add_argument("--max-batch", type=int, default=64, help="most queries encoded together in one micro-batch")
    p.add_argument("--max-wait-ms", type=float, default=50.0,
                   help="cap on how long a micro-batch waits for the last batch's clients to come back "
                        "(the wait is also at most 1/4 of the last batch's compute time; a lone client never waits)")
    # limits
    d = Limits()
    p.add_argument("--max-queries", type=int, default=d.max_queries,
                   help="most queries in one request (Search-R1 sends a whole step's: 2,560 at 512 prompts x 5); "
                        "/health reports it and retrieval.client splits at it")
    p.add_argument("--max-query-chars", type=int, default=d.max_query_chars, help="longest query, in characters")
    p.add_argument("--max-topk", type=int, default=d.max_topk, help="largest topk a request may ask for")
    p.add_argument("--default-topk", type=int, default=d.default_topk, help="topk when a request sends none")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body")
    p.add_argument("--log-level", default="info", help="python / uvicorn log level")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")

    import uvicorn

    # Cheap checks first, before the port opens: a wrong index/encoder pair must fail loudly now,
    # not after clients have started waiting on it.
    try:
        manifest = read_manifest(a.index)
        if manifest["kind"] == "dense":
            resolve_encoder(manifest, a.encoder, a.index)
            index_file(a.index, manifest)  # an imported index whose file moved fails here, not after loading
        elif a.encoder:
            raise ManifestError(f"{a.index} is a BM25 index; --encoder {a.encoder} does not apply to it")
        elif a.faiss_gpu or a.faiss_gpus is not None or a.faiss_fp16:
            raise ManifestError(f"{a.index} is a BM25 index; --faiss-gpu/--faiss-gpus/--faiss-fp16 do not apply to it")
    except InputError as e:  # a corrupt or mismatched index, a missing encoder: a message, not a traceback
        return entry_point_error("retrieval.server", e)

    # The server shares its node with trainer ranks (and, here, with other jobs). OpenMP workers
    # that spin between parallel regions (the default) steal those cores, and on an oversubscribed
    # CPU a 2-thread encode measured 10-20x slower than with sleeping workers. The search process
    # inherits this before torch/FAISS load; an explicit OMP_WAIT_POLICY in the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def load():
        return SearchProcess(load_kwargs(a, manifest), threads=a.threads, warmup=a.max_batch, topk=a.default_topk)

    limits = Limits(a.max_queries, a.max_query_chars, a.max_topk, a.default_topk, a.max_body_bytes)
    server = None

    def stop():
        server.should_exit = True

    app = create_app(load, limits, a.max_batch, a.max_wait_ms / 1000, on_load_error=stop)
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level.lower(),
                                           access_log=False))
    server.run()
    return 1 if app.state.server_state["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
