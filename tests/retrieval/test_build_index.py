"""Index building: resume after a killed build, refusal of mixed builds, FAISS index kinds, CLI."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from retrieval.build_index import build_index, main, make_faiss_index
from utils.errors import InputError


def _vectors(index_dir):
    import faiss
    idx = faiss.read_index(str(Path(index_dir) / "index.faiss"))
    return idx.reconstruct_n(0, idx.ntotal)


def _copy_partial(src: Path, dst: Path) -> Path:
    """The state a killed build leaves: docs and shards, but no index.faiss and no manifest."""
    dst.mkdir(parents=True)
    for name in ("docs.arrow", "docs.done"):
        shutil.copy(src / name, dst / name)
    shutil.copytree(src / "emb", dst / "emb")
    return dst


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_sigkill(tmp_path, corpus_rows, minilm, dense_index, helpers):
    corpus = helpers.write_jsonl(tmp_path / "c.jsonl", corpus_rows[:32])
    out = tmp_path / "idx"
    cmd = [sys.executable, "-m", "retrieval.build_index", "--corpus", str(corpus), "--out", str(out),
           "--kind", "dense", "--encoder", minilm, "--shard-size", "4", "--batch-size", "4"]
    proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=helpers.server_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(list((out / "emb").glob("*.done"))) < 2:
            assert proc.poll() is None, "build exited before it could be killed"
            assert time.monotonic() < deadline, "build made no progress"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no cleanup handlers run: the hardest kind of interruption
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    done = sorted((out / "emb").glob("*.done"))
    assert 2 <= len(done) < 8 and not (out / "manifest.json").exists()
    finished = {p.with_suffix(".npy"): p.with_suffix(".npy").stat().st_mtime_ns for p in done}

    m = build_index(corpus, out, "dense", encoder_path=minilm, shard_size=4, batch_size=4)
    assert m["count"] == 32 and len(list((out / "emb").glob("*.done"))) == 8
    for path, mtime in finished.items():  # shards finished before the kill were not encoded again
        assert path.stat().st_mtime_ns == mtime
    # and the resumed index equals one built in a single go (other shard/batch sizes: same vectors)
    np.testing.assert_allclose(_vectors(out), _vectors(dense_index)[:32], atol=1e-5)


def test_unfinished_shard_is_redone(tmp_path, tiny_corpus, minilm, dense_index):
    out = _copy_partial(dense_index, tmp_path / "idx")
    # shard 1 was being written when the build died: garbage data and no .done marker
    (out / "emb" / "shard_00001.done").unlink()
    (out / "emb" / "shard_00001.npy").write_bytes(b"half a file")
    (out / "emb" / "shard_00002.npy.tmp").write_bytes(b"leftover temp")
    kept = (out / "emb" / "shard_00000.npy").stat().st_mtime_ns
    build_index(tiny_corpus, out, "dense", encoder_path=minilm, shard_size=32, batch_size=16)
    assert (out / "emb" / "shard_00000.npy").stat().st_mtime_ns == kept
    np.testing.assert_allclose(_vectors(out), _vectors(dense_index), atol=1e-5)


def test_resume_with_other_settings_is_refused(tmp_path, tiny_corpus, minilm, dense_index):
    out = _copy_partial(dense_index, tmp_path / "idx")
    with pytest.raises(InputError, match="other settings"):  # the user's flags: a message at the command line
        build_index(tiny_corpus, out, "dense", encoder_path=minilm, shard_size=16)
    with pytest.raises(InputError, match="other settings"):  # the user's flags: a message at the command line
        build_index(tiny_corpus, out, "dense", encoder_path=minilm, shard_size=32, query_prefix="query: ")


def test_hnsw_from_existing_shards(tmp_path, tiny_corpus, minilm, dense_index, dense_retriever):
    """Shards are reusable: a second index type over the same embeddings encodes nothing."""
    from retrieval.retriever import load_retriever

    out = _copy_partial(dense_index, tmp_path / "hnsw")
    t0 = time.time()
    m = build_index(tiny_corpus, out, "dense", encoder_path=minilm, shard_size=32, batch_size=16, index_type="hnsw")
    assert m["index_type"] == "hnsw" and m["encode_seconds"] < 1.0, m
    hnsw = load_retriever(out)
    queries = ["20th century music", "ancient greek philosophy", "the largest ocean"]
    assert [[d["id"] for d in r] for r in hnsw.search(queries, 3)] == \
           [[d["id"] for d in r] for r in dense_retriever.search(queries, 3)]
    assert time.time() - t0 < 60


def test_finished_index_is_not_overwritten_by_accident(tmp_path, tiny_corpus, dense_index):
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_index(tiny_corpus, dense_index, "bm25")
    precious = tmp_path / "my_project"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing to delete"):
        build_index(tiny_corpus, precious, "bm25", overwrite=True)
    assert (precious / "notes.txt").exists()


def _clustered(n, d, seed):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(40, d))
    x = centers[rng.integers(0, 40, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("kind,fp16,min_recall", [("flat", False, 1.0), ("flat", True, 0.98), ("hnsw", False, 0.95),
                                                   ("hnsw", True, 0.9), ("ivfpq", False, 0.4)])
def test_faiss_index_kinds_recall(kind, fp16, min_recall):
    import faiss

    x, q = _clustered(3000, 64, 0), _clustered(50, 64, 1)
    exact = faiss.IndexFlatIP(64)
    exact.add(x)
    _, want = exact.search(q, 10)
    idx, params = make_faiss_index(64, len(x), kind, fp16, hnsw_m=16, ef_construction=100, nlist=None, pq_m=None)
    if not idx.is_trained:
        idx.train(x)
    idx.add(x)
    if kind == "ivfpq":
        idx.nprobe = params["nprobe"]
    if kind == "hnsw":
        idx.hnsw.efSearch = params["ef_search"]
    _, got = idx.search(q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(want, got)])
    assert recall >= min_recall, (kind, fp16, recall)


def test_ivfpq_on_a_tiny_corpus_says_why():
    with pytest.raises(ValueError, match="at least 256 documents"):
        make_faiss_index(384, 96, "ivfpq", False, 32, 200, None, None)
    with pytest.raises(ValueError, match="must divide"):
        make_faiss_index(384, 10000, "ivfpq", False, 32, 200, None, 7)


def test_cli_bm25_and_flag_errors(tmp_path, tiny_corpus, capsys):
    out = tmp_path / "bm25"
    assert main(["--corpus", str(tiny_corpus), "--out", str(out), "--kind", "bm25"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert (m["kind"], m["count"], m["metric"]) == ("bm25", 64, "bm25")
    assert main(["--corpus", str(tiny_corpus), "--out", str(out), "--kind", "bm25"]) == 2  # exists, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["--corpus", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x"), "--kind", "bm25"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--corpus", str(tiny_corpus), "--out", str(tmp_path / "d"), "--kind", "dense"])  # no --encoder
    assert "--encoder" in capsys.readouterr().err


def test_manifest_records_what_the_server_needs(dense_index, minilm):
    from retrieval.encoder import fingerprint

    m = json.loads((dense_index / "manifest.json").read_text())
    assert {k: m[k] for k in ("kind", "count", "dim", "metric", "index_type", "query_prefix", "passage_prefix",
                              "pooling", "normalize")} == {
        "kind": "dense", "count": 64, "dim": 384, "metric": "inner_product", "index_type": "flat",
        "query_prefix": "", "passage_prefix": "", "pooling": "mean", "normalize": True}
    assert m["encoder_fingerprint"] == fingerprint(minilm)
    assert m["encoder_path"] == str(Path(minilm).resolve()) and m["encoder_name"].endswith("model")
    assert os.path.exists(dense_index / "docs.arrow")


def test_bm25s_import_keeps_jax_off_the_gpus():
    """bm25s runs a JAX top-k at import; on a CUDA machine with JAX installed that preallocated 75% of
    an H100 in every process loading a BM25 index (scripts/gpu_check.sh). JAX is pinned to the CPU
    unless the user set JAX_PLATFORMS."""
    import subprocess
    import sys

    code = "import os; from retrieval.manifest import import_bm25s; import_bm25s(); print(os.environ['JAX_PLATFORMS'])"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert out[-1] == "cpu"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cuda"), capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert out[-1] == "cuda"
