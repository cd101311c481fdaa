"""Search-R1's prebuilt retrieval assets (e5_Flat.index + wiki-18.jsonl) served through retrieval.import_searchr1.

The assets are made here the way Search-R1 makes them (search_r1/search/index_builder.py): a JSONL corpus
{"id", "contents": "\"Title\"\\ntext"}, passages encoded as "passage: " + contents with AutoModel, mean
pooling over the attention mask and L2 normalisation, faiss.index_factory(dim, "Flat", METRIC_INNER_PRODUCT),
faiss.write_index to e5_Flat.index. all-MiniLM-L6-v2 stands in for e5-base-v2 (no download here); the
file name "e5_..." gives it e5's prefixes, as Search-R1's --retriever_name e5 does.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from retrieval.import_searchr1 import (SearchR1ImportError, import_searchr1, index_type_of, read_faiss_header,
                                       read_flat_rows, retriever_name_of, searchr1_settings)
from retrieval.manifest import EncoderMismatch, ManifestError, read_manifest
from retrieval.retriever import load_retriever


def searchr1_encode(model_path: str, texts: list[str], is_query: bool, max_length: int = 256) -> np.ndarray:
    """Search-R1's Encoder.encode / Index_Builder.encode_all for an "e5" retriever, written out independently."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, use_fast=True)
    model = AutoModel.from_pretrained(model_path).eval()
    texts = [("query: " if is_query else "passage: ") + t for t in texts]
    out = []
    with torch.no_grad():
        for s in range(0, len(texts), 16):
            inputs = tok(texts[s:s + 16], max_length=max_length, padding=True, truncation=True, return_tensors="pt")
            h = model(**inputs, return_dict=True).last_hidden_state
            m = inputs["attention_mask"]
            emb = h.masked_fill(~m[..., None].bool(), 0.0).sum(dim=1) / m.sum(dim=1)[..., None]
            out.append(torch.nn.functional.normalize(emb, dim=-1).numpy().astype(np.float32, order="C"))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def searchr1_assets(tmp_path_factory, corpus_rows, minilm):
    """(folder, index path, corpus path, rows, passage vectors) in Search-R1's layout and naming."""
    import faiss

    d = tmp_path_factory.mktemp("searchr1")
    rows = []
    for i, r in enumerate(corpus_rows[:40]):  # wiki-18 style: ids "0".."n-1", the title quoted on line 1
        title, text = r["contents"].split("\n", 1)
        rows.append({"id": str(i), "contents": f'"{title}"\n{text}'})
    corpus = d / "wiki-18.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    emb = searchr1_encode(minilm, [r["contents"] for r in rows], is_query=False)
    index = faiss.index_factory(emb.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(emb)
    faiss.write_index(index, str(d / "e5_Flat.index"))
    return d, d / "e5_Flat.index", corpus, rows, emb


@pytest.fixture(scope="module")
def imported(searchr1_assets, minilm, tmp_path_factory):
    _, index, corpus, _, _ = searchr1_assets
    out = tmp_path_factory.mktemp("imported") / "e5_wiki18"
    import_searchr1(index, corpus, minilm, out)
    return out


def test_header_and_rows_are_read_from_the_file_without_loading_it(tmp_path, searchr1_assets):
    import faiss

    _, index, _, _, emb = searchr1_assets
    h = read_faiss_header(index)
    assert h["fourcc"] == "IxFI" and h["dim"] == 384 and h["ntotal"] == 40 and h["metric"] == "inner_product"
    assert index_type_of(h["fourcc"]) == "flat" and h["rows_offset"] is not None
    np.testing.assert_array_equal(read_flat_rows(index, h, [0, 17, 39]), emb[[0, 17, 39]])
    x = emb[:40]
    for factory, metric, fourcc, kind in [("Flat", faiss.METRIC_L2, "IxF2", "flat"),
                                          ("HNSW8", faiss.METRIC_INNER_PRODUCT, "IHNf", "hnsw"),
                                          ("IVF2,Flat", faiss.METRIC_INNER_PRODUCT, "IwFl", "ivf")]:
        idx = faiss.index_factory(384, factory, metric)
        idx.train(x)
        idx.add(x)
        faiss.write_index(idx, str(tmp_path / "x.index"))
        h = read_faiss_header(tmp_path / "x.index")
        assert (h["fourcc"], h["dim"], h["ntotal"], index_type_of(h["fourcc"])) == (fourcc, 384, 40, kind)
        assert (h["rows_offset"] is not None) == (kind == "flat")
    (tmp_path / "junk.index").write_bytes(b"not an index at all, just some bytes here")
    with pytest.raises(SearchR1ImportError, match="does not look like a FAISS index"):
        read_faiss_header(tmp_path / "junk.index")


def test_searchr1_naming_rules():
    assert retriever_name_of("/x/e5_Flat.index") == "e5" and retriever_name_of("e5_HNSW64.index") == "e5"
    assert retriever_name_of("bge_Flat.index") == "bge"
    e5 = searchr1_settings("e5")
    assert e5 == {"pooling": "mean", "normalize": True, "query_prefix": "query: ", "passage_prefix": "passage: ",
                  "max_length": 256}
    assert searchr1_settings("bge")["query_prefix"].startswith("Represent this sentence")
    assert searchr1_settings("dpr")["normalize"] is False


@pytest.mark.timeout(300)
def test_imported_index_finds_the_right_doc_with_direct_faiss_scores(imported, searchr1_assets, minilm):
    """A query written from a doc's text returns that doc first, with the ids and scores a direct faiss
    search of Search-R1's own query vectors ("query: " + text) gives."""
    import faiss

    _, index_path, corpus, rows, _ = searchr1_assets
    m = read_manifest(imported)
    assert m["index_file"] == str(index_path.resolve()) and not (imported / "index.faiss").exists()  # read in place
    assert (m["query_prefix"], m["passage_prefix"], m["pooling"], m["max_length"]) == ("query: ", "passage: ", "mean", 256)
    assert m["imported_from"]["check"]["min_cosine"] > 0.9999 and len(m["imported_from"]["check"]["rows"]) == 16

    r = load_retriever(imported)
    assert r.describe()["count"] == 40 and r.describe()["query_prefix"] == "query: "
    probe = []
    for i in (0, 7, 19, 33):
        title, text = rows[i]["contents"].split("\n", 1)
        title = title.strip('"')
        probe.append((f"{title}: {' '.join(text.split()[:12])}", rows[i]["id"]))
    qs = [q for q, _ in probe]
    got = r.search(qs, topk=5)
    want_s, want_i = faiss.read_index(str(index_path)).search(searchr1_encode(minilm, qs, is_query=True), 5)
    for (q, doc_id), docs, ws, wi in zip(probe, got, want_s, want_i):
        assert docs[0]["id"] == doc_id, (q, [d["id"] for d in docs])
        assert docs[0]["contents"] == rows[int(doc_id)]["contents"]
        assert [d["id"] for d in docs] == [rows[i]["id"] for i in wi]  # row i of the index = line i of the corpus
        np.testing.assert_allclose([d["score"] for d in docs], ws, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_mismatches_are_refused(searchr1_assets, minilm, other_encoder, tmp_path, helpers):
    _, index, corpus, rows, _ = searchr1_assets
    # the encoder without e5's "passage: " prefix does not reproduce the stored vectors
    with pytest.raises(EncoderMismatch, match="does not reproduce the vectors"):
        import_searchr1(index, corpus, minilm, tmp_path / "a", passage_prefix="")
    assert not (tmp_path / "a" / "manifest.json").exists()
    # ... nor does a corpus in another order (row i must be line i)
    shuffled = helpers.write_jsonl(tmp_path / "shuffled.jsonl", rows[1:] + rows[:1])
    with pytest.raises(EncoderMismatch):
        import_searchr1(index, shuffled, minilm, tmp_path / "b")
    # a corpus with another number of documents
    short = helpers.write_jsonl(tmp_path / "short.jsonl", rows[:-1])
    with pytest.raises(SearchR1ImportError, match="40 vectors but .* has 39 documents"):
        import_searchr1(index, short, minilm, tmp_path / "c")
    # an encoder of another dim
    with pytest.raises(SearchR1ImportError, match="384-d vectors but encoder .* gives 32-d"):
        import_searchr1(index, corpus, other_encoder, tmp_path / "d")
    # --check-docs 0 imports regardless (the user's call)
    m = import_searchr1(index, corpus, minilm, tmp_path / "e", passage_prefix="", check_docs=0)
    assert m["imported_from"]["check"] is None


@pytest.mark.timeout(300)
def test_moved_index_and_index_file_passed_as_folder_are_explained(searchr1_assets, minilm, tmp_path):
    import shutil

    _, index, corpus, _, _ = searchr1_assets
    moved = tmp_path / "e5_Flat.index"
    shutil.copy(index, moved)
    out = tmp_path / "imp"
    import_searchr1(moved, corpus, minilm, out, check_docs=2)
    moved.unlink()
    with pytest.raises(FileNotFoundError, match="has moved; rerun retrieval.import_searchr1"):
        load_retriever(out)
    with pytest.raises(ManifestError, match="python -m retrieval.import_searchr1"):
        load_retriever(index)  # their .index file where an index folder belongs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_then_server_serve_searchr1_assets(searchr1_assets, minilm, tmp_path, launcher, helpers):
    """The one-command import, then our server over it answers Search-R1's /retrieve like the in-process retriever."""
    import httpx

    _, index, corpus, rows, _ = searchr1_assets
    out = tmp_path / "e5_wiki18"
    cmd = [sys.executable, "-m", "retrieval.import_searchr1", "--index", str(index), "--corpus", str(corpus),
           "--encoder", minilm, "--out", str(out)]
    res = subprocess.run(cmd, cwd=helpers.REPO, env=helpers.server_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "python -m retrieval.server --index" in res.stdout
    again = subprocess.run(cmd, cwd=helpers.REPO, env=helpers.server_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 2 and "already holds a finished index" in again.stderr
    # the server refuses the bare .index file before opening its port, with the way out
    bad = subprocess.run([sys.executable, "-m", "retrieval.server", "--index", str(index)], cwd=helpers.REPO,
                         env=helpers.server_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "retrieval.import_searchr1" in bad.stderr

    _, url = launcher.start_ready(out)
    q = rows[5]["contents"].split("\n", 1)[1][:80]
    body = httpx.post(f"{url}/retrieve", json={"queries": [q], "topk": 3, "return_scores": True}, timeout=60).json()
    top = body["result"][0]
    assert top[0]["document"] == rows[5]
    want = load_retriever(out).search([q], 3)[0]
    assert [t["document"]["id"] for t in top] == [d["id"] for d in want]
    assert [t["score"] for t in top] == pytest.approx([d["score"] for d in want], abs=1e-4)
    health = httpx.get(f"{url}/health").json()
    assert health["count"] == 40 and health["query_prefix"] == "query: "
