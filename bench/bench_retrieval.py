"""Retrieval benchmark: micro-batching server vs per-request baseline, and retrieval quality.

    bash scripts/build_index.sh                      # data/indexes/{bm25,minilm_flat}, once
    .venv/bin/python bench/bench_retrieval.py        # ~4 min; writes bench/results.json + bench/RESULTS.md

Throughput: retrieval.server (ours: dynamic micro-batching) and bench/baseline_server.py (one
encode + one FAISS search per request, FastAPI sync endpoint, as Search-R1 ships) run side by
side on the same dense index (all-MiniLM-L6-v2 + Flat over data/corpus/wiki.jsonl) with the same
CPU thread setting. For each number of concurrent clients, each server gets the same closed-loop
load (every client sends one FanOutQA question per request and sends the next as soon as the
answer comes) in short slices that alternate between the two servers, --repeats rounds of one
slice each. The machine is shared, so load from other jobs comes and goes: the QPS ratio is the
median of the per-round ratios (each round's two slices are seconds apart), latencies are
percentiles over all requests of all rounds.

Quality: hit@1 / hit@5 of the evidence page on data/eval/fanoutqa_singlehop.jsonl, BM25 and dense,
in-process over the full corpus.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The code this section measures (bench/report.py --check flags the section when it changes).
MEASURES = ["bench/baseline_server.py", "bench/bench_retrieval.py", "retrieval"]

from bench.report import md_table, write_results  # noqa: E402
from retrieval.quality import hit_at_k, read_eval_rows  # noqa: E402
from utils.assets import fanoutqa_dev  # noqa: E402
from retrieval.client import wait_for_health  # noqa: E402


def fanoutqa_questions() -> list[str]:
    """Every question and sub-question of FanOutQA dev: realistic search-agent queries (~2.4k)."""
    out = []

    def walk(q):
        out.append(q["question"].strip())
        for sub in q.get("decomposition") or []:
            walk(sub)
    for q in json.loads(fanoutqa_dev().read_text()):
        walk(q)
    qs = sorted({q for q in out if q})
    random.Random(0).shuffle(qs)
    return qs


def start_server(cmd: list[str], log: Path) -> subprocess.Popen:
    # Same environment for both servers; OMP_WAIT_POLICY=PASSIVE is retrieval.server's default and
    # is given to the baseline too, so the comparison isolates the request handling.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


async def closed_loop(url: str, queries: list[str], clients: int, duration: float, topk: int) -> dict:
    """`clients` concurrent clients, one query per request, for `duration` seconds.

    The load comes from aiohttp, not httpx: on this 2-core box httpx's async client itself
    topped out at ~50 requests/s with 64 connections (even against a trivial GET /health), so it
    measured the load generator rather than the servers. aiohttp did ~1500/s there.
    """
    import aiohttp

    lat, errors = [], {}
    pos = random.randrange(len(queries))
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(base_url=url, connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.perf_counter()
        end = t0 + duration

        async def worker():
            nonlocal pos
            while time.perf_counter() < end:
                q = queries[pos % len(queries)]
                pos += 1
                t = time.perf_counter()
                try:
                    async with s.post("/retrieve", json={"queries": [q], "topk": topk, "return_scores": True}) as r:
                        body = await r.json()
                        ok = r.status == 200 and len(body["result"][0]) == topk
                        why = f"HTTP {r.status}" if r.status != 200 else "short result"
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                    ok, why = False, type(e).__name__
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors[why] = errors.get(why, 0) + 1
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    lat.sort()

    def pct(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")
    return {"qps": len(lat) / elapsed, "p50_ms": pct(0.50), "p99_ms": pct(0.99), "n": len(lat),
            "errors": sum(errors.values()), "error_kinds": errors, "lat_ms": [x * 1000 for x in lat]}


def check_same_answers(urls: list[str], queries: list[str], topk: int) -> None:
    """Both servers must return the same documents, or the comparison is meaningless."""
    from retrieval.client import RetrievalClient

    got = []
    for url in urls:
        with RetrievalClient(url) as c:
            got.append([[d["id"] for d in row] for row in c.search(queries, topk)])
    if got[0] != got[1]:
        raise RuntimeError(f"servers disagree on the results: {urls[0]} vs {urls[1]}")


def batching_ceiling(index: Path, queries: list[str], threads: int, n: int = 32, reps: int = 5) -> dict:
    """In-process search cost per query, alone vs in batches of n: what batching can give on this hardware.

    Everything the server adds (HTTP, queueing) is left out; this is the encoder + FAISS alone.
    """
    import torch

    from retrieval.retriever import load_retriever

    torch.set_num_threads(threads)
    r = load_retriever(index)
    r.search_ids(queries[:n], 3)  # warm-up
    alone, batched = [], []
    for k in range(reps):
        qs = queries[(k + 1) * n:(k + 2) * n]
        t = time.perf_counter()
        for q in qs:
            r.search_ids([q], 3)
        alone.append((time.perf_counter() - t) / n * 1000)
        t = time.perf_counter()
        r.search_ids(qs, 3)
        batched.append((time.perf_counter() - t) / n * 1000)
    a, b = statistics.median(alone), statistics.median(batched)
    return {"alone_ms": a, "batched_ms": b, "gain": a / b, "n": n}


def quality(bm25_index: Path, dense_index: Path, eval_path: Path) -> dict:
    from retrieval.retriever import load_retriever

    rows = read_eval_rows(eval_path)
    return {"bm25": hit_at_k(load_retriever(bm25_index).search, rows),
            "dense": hit_at_k(load_retriever(dense_index).search, rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # inputs
    p.add_argument("--index", default="data/indexes/minilm_flat", help="dense index both servers serve")
    p.add_argument("--bm25-index", default="data/indexes/bm25", help="BM25 index for the quality figures")
    p.add_argument("--eval", default="data/eval/fanoutqa_singlehop.jsonl", help="questions with evidence_titles")
    # load
    p.add_argument("--clients", default="1,8,32,64", help="comma-separated numbers of concurrent clients")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of one load slice (server, clients, round)")
    p.add_argument("--repeats", type=int, default=5, help="paired rounds per number of clients")
    p.add_argument("--topk", type=int, default=3, help="documents per query")
    p.add_argument("--threads", type=int, default=2, help="torch/FAISS threads in each server (same for both)")
    p.add_argument("--max-batch", type=int, default=64, help="ours: most queries per micro-batch")
    p.add_argument("--max-wait-ms", type=float, default=50.0, help="ours: cap on the micro-batch fill wait")
    p.add_argument("--ports", default="18410,18411", help="ports for ours,baseline on 127.0.0.1")
    # output
    p.add_argument("--skip-quality", action="store_true", help="only the throughput part")
    p.add_argument("--no-write", action="store_true", help="print, do not write bench/results.json / RESULTS.md")
    a = p.parse_args(argv)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in the servers, for the in-process figures
    index, bm25_index, eval_path = REPO / a.index, REPO / a.bm25_index, REPO / a.eval
    for path in (index, bm25_index):
        if not (path / "manifest.json").exists():
            print(f"bench_retrieval: no index in {path}; run `bash scripts/build_index.sh` first", file=sys.stderr)
            return 2
    levels = [int(x) for x in a.clients.split(",")]
    port_ours, port_base = (int(x) for x in a.ports.split(","))
    queries = fanoutqa_questions()
    manifest = json.loads((index / "manifest.json").read_text())
    logdir = REPO / "runs" / "bench_retrieval"
    logdir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    servers = {
        "ours": (f"http://127.0.0.1:{port_ours}",
                 [py, "-m", "retrieval.server", "--index", str(index), "--port", str(port_ours), "--threads",
                  str(a.threads), "--max-batch", str(a.max_batch), "--max-wait-ms", str(a.max_wait_ms),
                  "--log-level", "warning"]),
        "baseline": (f"http://127.0.0.1:{port_base}",
                     [py, "bench/baseline_server.py", "--index", str(index), "--port", str(port_base),
                      "--threads", str(a.threads)]),
    }
    procs = {}
    load_start = os.getloadavg()
    try:
        for name, (url, cmd) in servers.items():
            procs[name] = start_server(cmd, logdir / f"{name}.log")
        for name, (url, _) in servers.items():
            wait_for_health(url, procs[name], 600, log=logdir / f"{name}.log", poll=0.5, request_timeout=5)
            asyncio.run(closed_loop(url, queries, 8, 2.0, a.topk))  # warm-up: first-call allocations, caches
        check_same_answers([u for u, _ in servers.values()], queries[:16], a.topk)
        runs = {(s, c): [] for s in servers for c in levels}
        for r in range(a.repeats):
            for c in levels:
                order = ["ours", "baseline"] if (r + c) % 2 == 0 else ["baseline", "ours"]
                for s in order:
                    res = asyncio.run(closed_loop(servers[s][0], queries, c, a.duration, a.topk))
                    runs[s, c].append(res)
                    print(f"repeat {r} clients {c:3d} {s:8s} qps {res['qps']:7.1f} p50 {res['p50_ms']:7.1f} ms "
                          f"p99 {res['p99_ms']:7.1f} ms errors {res['errors']} {res['error_kinds'] or ''}", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    load_end = os.getloadavg()

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    errors = {s: sum(x["errors"] for c in levels for x in runs[s, c]) for s in servers}
    keys, rows = {}, []
    for c in levels:
        qps = {s: statistics.median(x["qps"] for x in runs[s, c]) for s in servers}
        lat = {s: [v for x in runs[s, c] for v in x["lat_ms"]] for s in servers}
        p50 = {s: pct(lat[s], 0.50) for s in servers}
        p99 = {s: pct(lat[s], 0.99) for s in servers}
        ratios = sorted(o["qps"] / b["qps"] for o, b in zip(runs["ours", c], runs["baseline", c]))
        qr, pr = statistics.median(ratios), p99["ours"] / p99["baseline"]
        keys.update({f"retrieval.qps_ratio_{c}": round(qr, 3), f"retrieval.p99_ratio_{c}": round(pr, 3),
                     f"retrieval.ours_qps_{c}": round(qps["ours"], 1),
                     f"retrieval.baseline_qps_{c}": round(qps["baseline"], 1),
                     f"retrieval.ours_p99_ms_{c}": round(p99["ours"], 1),
                     f"retrieval.baseline_p99_ms_{c}": round(p99["baseline"], 1)})
        rows.append([c, round(qps["ours"], 1), round(qps["baseline"], 1),
                     f"{qr:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})", round(p50["ours"], 1), round(p50["baseline"], 1),
                     round(p99["ours"], 1), round(p99["baseline"], 1), f"{pr:.2f}"])
    md = [f"Dense index `{a.index}` ({manifest['count']} docs, {manifest['encoder_name']}, {manifest['index_type']}), "
          f"both servers with {a.threads} CPU threads; one query per request, top-{a.topk}, closed loop, "
          f"{a.repeats} rounds of {a.duration:g} s slices alternating between the servers; QPS = median over rounds, "
          "QPS ratio = median of per-round ratios (range in brackets), p50/p99 over all requests. "
          f"Ours: micro-batching, max batch {a.max_batch}, fill wait <= min({a.max_wait_ms:g} ms, 1/4 of the last "
          "batch's compute), search in a child process. Baseline: "
          f"`bench/baseline_server.py` (FastAPI sync endpoint, one encode + FAISS search per request). "
          f"Failed requests: ours {errors['ours']}, baseline {errors['baseline']}. Load average (1/5/15 min) "
          f"at start {', '.join(f'{x:.1f}' for x in load_start)}, at end {', '.join(f'{x:.1f}' for x in load_end)} "
          "(the machine is shared; absolute numbers move with other load, ratios less so).", "",
          md_table(["clients", "ours QPS", "baseline QPS", "QPS ratio", "ours p50 ms", "baseline p50 ms",
                    "ours p99 ms", "baseline p99 ms", "p99 ratio (ours/base)"], rows)]
    ceil = batching_ceiling(index, queries, a.threads)
    keys["retrieval.encode_batch_gain_32"] = round(ceil["gain"], 2)
    met = keys.get("retrieval.qps_ratio_32", 0) >= 4 and keys.get("retrieval.p99_ratio_32", 9) < 1
    md += ["", f"Target (>= 4x the baseline's QPS at 32 clients, lower p99): **{'met' if met else 'not met'}**. "
           f"What batching can give on this hardware, measured in-process with {a.threads} threads (no HTTP): "
           f"search costs {ceil['alone_ms']:.1f} ms a query alone and {ceil['batched_ms']:.1f} ms a query in batches "
           f"of {ceil['n']}, a {ceil['gain']:.1f}x gain. On a CPU the MiniLM forward pass is bound by its FLOPs "
           "(~0.4 GFLOP a padded query), so batching only removes the per-call overhead; the server-level ratio "
           "can exceed this figure only by what the baseline also loses to its 40 request threads contending "
           "for the GIL and cores. On a GPU, where a one-query forward pass is almost all launch overhead, the "
           "same batching gives far more (not measured here: no GPU)."]
    if not a.skip_quality and eval_path.exists():
        q = quality(bm25_index, index, eval_path)
        keys.update({"retrieval.bm25_hit1": round(q["bm25"]["hit@1"], 3), "retrieval.bm25_hit5": round(q["bm25"]["hit@5"], 3),
                     "retrieval.dense_hit1": round(q["dense"]["hit@1"], 3), "retrieval.dense_hit5": round(q["dense"]["hit@5"], 3),
                     "retrieval.eval_n": q["dense"]["n"]})
        md += ["", f"Quality on `{a.eval}` ({q['dense']['n']} FanOutQA single-hop questions whose evidence page is in "
               "the corpus); a hit is a retrieved doc whose title is an evidence title. In-process, full corpus.", "",
               md_table(["retriever", "hit@1", "hit@5"],
                        [["BM25 (bm25s, lucene, en stopwords)", round(q["bm25"]["hit@1"], 3), round(q["bm25"]["hit@5"], 3)],
                         [f"dense ({manifest['encoder_name']} + {manifest['index_type']})", round(q["dense"]["hit@1"], 3),
                          round(q["dense"]["hit@5"], 3)]])]
    text = "\n".join(md)
    print(text)
    print(json.dumps(keys, indent=1))
    if not a.no_write:
        write_results("retrieval", keys, text, measures=MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
