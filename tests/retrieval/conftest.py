"""Fixtures for the retrieval tests: a tiny real corpus, real BM25 and MiniLM indexes, real servers.

The corpus is the first N articles of the bundled Wikipedia summaries (the package file, so the
tests do not depend on scripts/prepare_data.py having run). Everything heavy is session-scoped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrieval.client import wait_for_health
from utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]
N_DOCS = 64
SHARD = 32


def tiny_rows(n: int = N_DOCS, start: int = 0) -> list[dict]:
    from utils.assets import wiki_summaries

    src = json.loads(wiki_summaries().read_text())
    rows = []
    for key in sorted(src)[start:]:
        art = src[key]
        text = " ".join((art.get("extract") or "").split())
        if text:
            rows.append({"id": f"d{len(rows) + start}", "contents": f"{art.get('title') or key}\n{text}"})
        if len(rows) == n:
            break
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def minilm() -> str:
    from utils.assets import minilm_dir
    return str(minilm_dir())


@pytest.fixture(scope="session")
def corpus_rows() -> list[dict]:
    return tiny_rows()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory, corpus_rows) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "tiny.jsonl", corpus_rows)


@pytest.fixture(scope="session")
def bm25_index(tmp_path_factory, tiny_corpus) -> Path:
    from retrieval.build_index import build_index
    out = tmp_path_factory.mktemp("idx") / "bm25"
    build_index(tiny_corpus, out, "bm25")
    return out


@pytest.fixture(scope="session")
def dense_index(tmp_path_factory, tiny_corpus, minilm) -> Path:
    from retrieval.build_index import build_index
    out = tmp_path_factory.mktemp("idx") / "dense"
    build_index(tiny_corpus, out, "dense", encoder_path=minilm, shard_size=SHARD, batch_size=16)
    return out


@pytest.fixture(scope="session")
def dense_retriever(dense_index):
    from retrieval.retriever import load_retriever
    return load_retriever(dense_index)


@pytest.fixture(scope="session")
def bm25_retriever(bm25_index):
    from retrieval.retriever import load_retriever
    return load_retriever(bm25_index)


def server_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_server(index: Path, port: int, *extra: str, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "retrieval.server", "--index", str(index), "--port", str(port),
                             "--log-level", "warning", *extra], cwd=REPO, env=server_env(), stdout=out, stderr=out)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    wait_for_health(url, proc, timeout)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Launcher:
    """Start real server subprocesses; everything started is stopped at fixture teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, index: Path, *extra: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
        port = port or free_port()
        log = self.tmp / f"server_{port}.log"
        proc = start_server(index, port, *extra, log=log)
        proc.log_path = log
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    def start_ready(self, index: Path, *extra: str) -> tuple[subprocess.Popen, str]:
        proc, url = self.start(index, *extra)
        try:
            wait_ready(url, proc)
        except Exception as e:
            raise RuntimeError(f"{e}; log:\n{proc.log_path.read_text()[-3000:]}") from None
        return proc, url

    def close(self):
        for p in self.procs:
            stop(p)


@pytest.fixture
def launcher(tmp_path):
    lau = Launcher(tmp_path)
    yield lau
    lau.close()


def assert_same_results(got: list[list[dict]], want: list[list[dict]], tol: float = 1e-4) -> None:
    """Same docs in the same order; scores equal up to float noise (batch composition changes BLAS sums)."""
    assert [[d["id"] for d in r] for r in got] == [[d["id"] for d in r] for r in want]
    assert [[d["contents"] for d in r] for r in got] == [[d["contents"] for d in r] for r in want]
    for r, w in zip(got, want):
        for a, b in zip(r, w):
            assert abs(a["score"] - b["score"]) <= tol, (a["score"], b["score"])


@pytest.fixture(scope="session")
def helpers():
    """Plain helpers for test modules (conftests are not importable under --import-mode=importlib)."""
    import types
    return types.SimpleNamespace(same=assert_same_results, tiny_rows=tiny_rows, write_jsonl=write_jsonl, free_port=free_port,
                                 wait_ready=wait_ready, stop=stop, server_env=server_env, REPO=REPO)


@pytest.fixture(scope="session")
def dense_server(dense_index, tmp_path_factory):
    """A real server over the tiny MiniLM index on a free 127.0.0.1 port; yields its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "dense_server.log"
    proc = start_server(dense_index, port, "--max-batch", "64", log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except Exception:
        stop(proc)
        raise RuntimeError(f"dense server failed to start; log:\n{log.read_text()[-3000:]}")
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def bm25_server(bm25_index, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "bm25_server.log"
    proc = start_server(bm25_index, port, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except Exception:
        stop(proc)
        raise RuntimeError(f"bm25 server failed to start; log:\n{log.read_text()[-3000:]}")
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def other_encoder(tmp_path_factory, minilm) -> str:
    """A different (tiny, random) BERT encoder with MiniLM's tokenizer: the wrong model for our indexes."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = tmp_path_factory.mktemp("other_encoder")
    tok = AutoTokenizer.from_pretrained(minilm)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512)
    BertModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def minilm_elsewhere(tmp_path_factory, minilm) -> str:
    """The same MiniLM files under another path (symlinks), as on another machine."""
    out = tmp_path_factory.mktemp("minilm_copy") / "all-MiniLM-L6-v2"
    out.mkdir()
    for f in Path(minilm).iterdir():
        (out / f.name).symlink_to(f)
    return str(out)
