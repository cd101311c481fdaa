"""Which GPUs the FAISS index goes to (--faiss-gpus), and how many bytes it puts on each (retriever_gpu_bytes).

No GPU here: faiss-gpu's cloners are replaced (the fake_faiss_gpus fixture of tests/conftest.py) by CPU
faiss.IndexShards that split the vectors the way faiss-gpu does (contiguous slices, shard i on the i-th GPU named),
so the choice logic, the shard sizes and the search results are checked for real, for every index type
(tests/test_gpu_semantics.py held a copy of the sharding test, with HNSW, until issue 43).
"""

import argparse

import numpy as np
import pytest

from retrieval.retriever import (_to_gpus, check_gpu_ids, load_retriever, parse_gpu_ids, retriever_gpu_bytes)

WIKI18 = 21_015_324


def _data(n=601, d=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(n, 20, replace=False)] + 0.05 * rng.standard_normal((20, d)).astype("float32")
    return x, q


def test_parse_gpu_ids():
    assert parse_gpu_ids("0,1") == [0, 1] and parse_gpu_ids(" 3 , 1 ") == [3, 1] and parse_gpu_ids([2]) == [2]
    assert parse_gpu_ids(None) is None and parse_gpu_ids("") is None and parse_gpu_ids("all") is None
    for bad in ("a,b", "0,0", "-1", "1.5", ","):
        with pytest.raises(ValueError):
            parse_gpu_ids(bad)
    assert check_gpu_ids(None, 4) == [0, 1, 2, 3] and check_gpu_ids([3, 1], 4) == [3, 1]
    with pytest.raises(ValueError, match=r"GPU 4 does not exist here; this process sees 4 GPU\(s\).*CUDA_VISIBLE_DEVICES"):
        check_gpu_ids([1, 4], 4)


def test_retriever_gpu_bytes():
    # wiki-18 x e5-base-v2 (768-d): 64.56 GB float32 in all, split over the GPUs named, halved by fp16
    total = WIKI18 * 768 * 4
    assert total == 64_559_075_328
    assert retriever_gpu_bytes(WIKI18, 768, [0], False) == {0: total}
    two = retriever_gpu_bytes(WIKI18, 768, [6, 7], False)
    assert list(two) == [6, 7] and sum(two.values()) == total and two == {6: 32_279_537_664, 7: 32_279_537_664}
    half = retriever_gpu_bytes(WIKI18, 768, [6, 7], True)
    assert half == {g: b // 2 for g, b in two.items()}
    eight = retriever_gpu_bytes(WIKI18, 768, list(range(8)), True)
    assert sum(eight.values()) == total // 2 and max(eight.values()) - min(eight.values()) <= 768 * 2
    # uneven split: the rows go as faiss-gpu's contiguous slices do (n*i//k .. n*(i+1)//k)
    assert retriever_gpu_bytes(10, 4, [2, 0, 1], False) == {2: 3 * 16, 0: 3 * 16, 1: 4 * 16}
    for bad in ([], [1, 1]):
        with pytest.raises(ValueError):
            retriever_gpu_bytes(10, 4, bad, False)


def test_retriever_gpu_bytes_is_pure(helpers):
    """The memory planner may import it where faiss (or torch) is missing: neither is imported with the module."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['faiss'] = None; sys.modules['torch'] = None\n"
            "from retrieval.retriever import retriever_gpu_bytes\n"
            "print(retriever_gpu_bytes(8, 2, [0, 1], True))")
    res = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, env=helpers.server_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "{0: 16, 1: 16}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("named", [None, [3, 1]], ids=["all_gpus", "gpus_3_1"])
@pytest.mark.parametrize("kind,fp16", [("flat", False), ("flat", True), ("ivfpq", False), ("hnsw", False)])
def test_chosen_gpus_get_the_shards_and_results_stay_the_same(fake_faiss_gpus, kind, fp16, named):
    """retriever._to_gpus on every index type build_index makes, onto every visible GPU (no ids named) or the ones
    named: shards (not replicas) with the manifest's fp16 flag, on the named GPUs in their order, and searching the
    sharded index gives the unsharded index's hits; HNSW stays on the CPU (FAISS has no GPU HNSW)."""
    import faiss

    from retrieval.build_index import make_faiss_index

    x, q = _data()
    params = dict(hnsw_m=16, ef_construction=64, nlist=16, pq_m=8) if kind == "ivfpq" else dict(
        hnsw_m=16, ef_construction=64, nlist=None, pq_m=None)
    idx, _ = make_faiss_index(32, len(x), kind, fp16, **params)
    if not idx.is_trained:
        idx.train(x)
    idx.add(x)
    if kind == "ivfpq":
        faiss.extract_index_ivf(idx).nprobe = 16
    want_s, want_i = idx.search(q, 10)
    gpus = fake_faiss_gpus(4)
    got = _to_gpus(faiss, idx, {"index_type": kind, "fp16": fp16}, gpus=named)
    if kind == "hnsw":
        assert got is idx and gpus.calls == []
        return
    (call,) = gpus.calls
    assert (call["via"], call["gpus"]) == (("all", [0, 1, 2, 3]) if named is None else ("list", named))
    assert call["co"].shard is True and call["co"].useFloat16 is fp16
    assert got is not idx and got.ntotal == idx.ntotal
    if kind == "flat":
        # an fp16 build (IndexScalarQuantizer) is handed over as IndexFlat: faiss-gpu cannot shard the former
        assert call["index_type"] in ("IndexFlat", "IndexFlatIP")
        want_bytes = retriever_gpu_bytes(len(x), 32, call["gpus"], fp16)
        assert {g: r * 32 * (2 if fp16 else 4) for g, r in call["rows"].items()} == want_bytes
    got_s, got_i = got.search(q, 10)
    assert np.array_equal(got_i, want_i)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5)


def test_default_is_every_visible_gpu_and_bad_ids_are_refused(fake_faiss_gpus):
    import faiss

    x, q = _data()
    idx = faiss.IndexFlatIP(32)
    idx.add(x)
    gpus = fake_faiss_gpus(3)
    got = _to_gpus(faiss, idx, {"index_type": "flat", "fp16": False})
    assert gpus.calls[-1]["via"] == "all" and gpus.calls[-1]["gpus"] == [0, 1, 2]
    assert np.array_equal(got.search(q, 5)[1], idx.search(q, 5)[1])
    # fp16=True stores a float32 index as float16 on the GPUs (--faiss-fp16)
    _to_gpus(faiss, idx, {"index_type": "flat", "fp16": False}, gpus=[0], fp16=True)
    assert gpus.calls[-1]["co"].useFloat16 is True and gpus.calls[-1]["gpus"] == [0]
    n_calls = len(gpus.calls)
    with pytest.raises(ValueError, match="GPU 3 does not exist here"):
        _to_gpus(faiss, idx, {"index_type": "flat"}, gpus=[0, 3])
    assert len(gpus.calls) == n_calls  # refused before anything was cloned
    # HNSW has no GPU version: it stays on the CPU whatever GPUs are named
    h = faiss.IndexHNSWFlat(32, 8, faiss.METRIC_INNER_PRODUCT)
    assert _to_gpus(faiss, h, {"index_type": "hnsw"}, gpus=[1]) is h and len(gpus.calls) == n_calls


@pytest.mark.timeout(300)
def test_dense_retriever_on_chosen_gpus_returns_the_cpu_results(fake_faiss_gpus, dense_index, dense_retriever, helpers):
    import faiss

    gpus = fake_faiss_gpus(4)
    r = load_retriever(dense_index, faiss_gpus=[2, 3])  # naming GPUs turns faiss_gpu on
    assert gpus.calls[-1]["gpus"] == [2, 3] and gpus.calls[-1]["rows"] == {2: 32, 3: 32}
    qs = ["ancient greek philosophy", "abstract art movement", "chemistry element"]
    helpers.same(r.search(qs, 5), dense_retriever.search(qs, 5), tol=1e-5)


def test_server_flags_reach_the_retriever(dense_index, bm25_index, capsys):
    from retrieval.manifest import read_manifest
    from retrieval.server import _gpu_ids, load_kwargs, main

    m = read_manifest(dense_index)

    def ns(**kw):
        base = dict(index=str(dense_index), encoder=None, device="cuda:1", faiss_gpu=False, faiss_gpus=None,
                    faiss_fp16=False)
        return argparse.Namespace(**{**base, **kw})

    assert load_kwargs(ns(), m) == {"index_dir": str(dense_index), "encoder": None, "device": "cuda:1",
                                    "faiss_gpu": False, "faiss_gpus": None, "faiss_fp16": None}
    kw = load_kwargs(ns(faiss_gpus="6,7", faiss_fp16=True), m)
    assert (kw["faiss_gpu"], kw["faiss_gpus"], kw["faiss_fp16"]) == (True, [6, 7], True)
    kw = load_kwargs(ns(faiss_gpus="all"), m)
    assert (kw["faiss_gpu"], kw["faiss_gpus"]) == (True, None)
    with pytest.raises(argparse.ArgumentTypeError):
        _gpu_ids("0,x")
    with pytest.raises(SystemExit) as e:  # argparse refuses a bad list before anything loads
        main(["--index", str(dense_index), "--faiss_gpus", "0,0"])
    assert e.value.code == 2 and "distinct" in capsys.readouterr().err
    assert main(["--index", str(bm25_index), "--faiss-gpus", "0"]) == 2
    assert "BM25 index" in capsys.readouterr().err
