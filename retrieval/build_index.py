"""Build a BM25 or dense (FAISS) index folder from a JSONL / parquet corpus.

    python -m retrieval.build_index --corpus data/corpus/wiki.jsonl --out data/indexes/bm25 --kind bm25
    python -m retrieval.build_index --corpus data/corpus/wiki.jsonl --out data/indexes/minilm_flat \
        --kind dense --encoder "$(python -c 'from utils.assets import minilm_dir; print(minilm_dir())')"
    # wiki-18 with e5 on a GPU box ("query: "/"passage: " prefixes are picked up from the name; time and RAM
    # estimates in docs/retrieval.md; Search-R1's prebuilt e5_Flat.index: python -m retrieval.import_searchr1):
    python -m retrieval.build_index --corpus wiki-18.jsonl --out idx/e5_flat --kind dense \
        --encoder /models/e5-base-v2 --device cuda --fp16 --batch-size 512 --max-length 256 --shard-size 100000

The folder holds manifest.json (written last: its presence means "finished"), docs.arrow (the
documents) and either bm25/ or index.faiss. Dense embeddings are written per shard of
--shard-size documents as emb/shard_NNNNN.npy plus a .done marker, so a killed build rerun with
the same command skips the finished shards and only encodes the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from retrieval.corpus import DOCS_FILE, DocStore, write_docs
from retrieval.encoder import Encoder, fingerprint, model_name
from retrieval.manifest import MANIFEST, import_bm25s, write_manifest
from retrieval.retriever import make_stemmer
from utils.errors import InputError, InputFileExists, InputFileMissing, entry_point_error

log = logging.getLogger("retrieval.build_index")
INDEX_TYPES = ("flat", "hnsw", "ivfpq")


def prepare_out(out: Path, overwrite: bool) -> None:
    if overwrite and out.exists():
        # Only ever delete a folder that looks like one of ours: `--out . --overwrite` must not wipe a repo.
        ours = {MANIFEST, DOCS_FILE, "docs.done", "emb", "bm25", "index.faiss"}
        if not any((out / name).exists() for name in ours):
            raise InputFileExists(f"--overwrite: {out} exists but holds no index files; refusing to delete it")
        shutil.rmtree(out)
    elif (out / MANIFEST).exists():
        raise InputFileExists(f"{out} already holds a finished index ({MANIFEST} exists); pass --overwrite to rebuild")
    out.mkdir(parents=True, exist_ok=True)


def _corpus_stamp(corpus: Path) -> dict:
    st = corpus.stat()
    return {"corpus": str(corpus.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}


def ensure_docs(corpus: Path, out: Path) -> int:
    """Copy the corpus into docs.arrow once; a rerun over an unchanged corpus reuses it."""
    marker = out / "docs.done"
    stamp = _corpus_stamp(corpus)
    if marker.exists() and (out / DOCS_FILE).exists():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in stamp} == stamp:
            log.info("docs.arrow already written (%d docs), reusing it", done["count"])
            return done["count"]
        raise InputError(f"{out} holds a partial build from another corpus ({done['corpus']}); "
                           "pass --overwrite or pick another --out")
    n = write_docs(corpus, out)
    marker.write_text(json.dumps({**stamp, "count": n}) + "\n")
    return n


# --------------------------------------------------------------------------------------- BM25

def build_bm25(corpus: Path, out: Path, k1: float = 1.5, b: float = 0.75, method: str = "lucene",
               stopwords: str = "en", stemmer: str | None = None) -> dict:
    bm25s = import_bm25s()

    n = ensure_docs(corpus, out)
    texts = DocStore(out).all_contents()
    tokens = bm25s.tokenize(texts, stopwords=stopwords or None, stemmer=make_stemmer(stemmer), return_ids=True,
                            show_progress=True)
    model = bm25s.BM25(k1=k1, b=b, method=method)
    model.index(tokens, show_progress=True)
    tmp = out / "bm25.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save(str(tmp), show_progress=False)
    shutil.rmtree(out / "bm25", ignore_errors=True)
    os.replace(tmp, out / "bm25")
    return {"kind": "bm25", "count": n, "metric": "bm25", "index_type": "bm25",
            "bm25": {"k1": k1, "b": b, "method": method, "stopwords": stopwords, "stemmer": stemmer}}


# -------------------------------------------------------------------------------------- dense

def encode_shards(encoder, docs: DocStore, emb_dir: Path, shard_size: int, batch_size: int,
                  store_dtype=np.float32) -> list[Path]:
    """Encode docs shard by shard; finished shards (with a .done marker) are skipped.

    Each shard is written to a temp file and renamed before its marker appears, so a kill at
    any point leaves either a complete shard with its marker or no marker (and a redo).
    """
    from tqdm import tqdm

    n = len(docs)
    n_shards = math.ceil(n / shard_size)
    paths = [emb_dir / f"shard_{s:05d}.npy" for s in range(n_shards)]
    todo = [s for s in range(n_shards) if not paths[s].with_suffix(".done").exists()]
    if len(todo) < n_shards:
        log.info("resuming: %d of %d shards already encoded, skipping them", n_shards - len(todo), n_shards)
    bar = tqdm(total=n, initial=n - sum(min(shard_size, n - s * shard_size) for s in todo), desc="encoding passages",
               unit="doc", smoothing=0.05)
    for s in todo:
        lo, hi = s * shard_size, min(n, (s + 1) * shard_size)
        emb = encoder.encode(docs.contents(lo, hi), is_query=False, batch_size=batch_size,
                             on_batch=bar.update).astype(store_dtype)
        tmp = paths[s].with_suffix(".npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, emb)
        os.replace(tmp, paths[s])
        paths[s].with_suffix(".done").write_text(f"{lo} {hi}\n")
    bar.close()
    return paths


def make_faiss_index(dim: int, n: int, index_type: str, fp16: bool, hnsw_m: int, ef_construction: int,
                     nlist: int | None, pq_m: int | None):
    """An empty (untrained) inner-product FAISS index of the chosen kind, plus its recorded params."""
    import faiss

    ip = faiss.METRIC_INNER_PRODUCT
    if index_type == "flat":
        # fp16 stores each vector as 2 bytes a dim: half the memory, exact search up to rounding.
        idx = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, ip) if fp16 else faiss.IndexFlatIP(dim)
        return idx, {}
    if index_type == "hnsw":
        idx = faiss.IndexHNSWSQ(dim, faiss.ScalarQuantizer.QT_fp16, hnsw_m, ip) if fp16 else faiss.IndexHNSWFlat(dim, hnsw_m, ip)
        idx.hnsw.efConstruction = ef_construction
        return idx, {"M": hnsw_m, "ef_construction": ef_construction, "ef_search": max(128, ef_construction // 2)}
    if index_type == "ivfpq":
        nlist = nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))  # FAISS wants >= 39 training points a list
        pq_m = pq_m or next(m for m in (dim // 8, dim // 4, dim // 2, dim) if dim % m == 0)
        if dim % pq_m:
            raise InputError(f"--pq-m {pq_m} must divide the embedding dim {dim}")
        if n < max(256, nlist):
            raise InputError(f"IVF-PQ needs at least {max(256, nlist)} documents to train (256 PQ centroids, "
                             f"{nlist} lists); this corpus has {n}. Use --index flat or hnsw")
        idx = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, pq_m, 8, ip)
        return idx, {"nlist": nlist, "pq_m": pq_m, "nprobe": min(nlist, 32)}
    raise InputError(f"--index {index_type!r} is not one of {INDEX_TYPES}")


def build_dense(corpus: Path, out: Path, encoder_path: str, device: str = "cpu", index_type: str = "flat",
                fp16: bool = False, shard_size: int = 2000, batch_size: int = 64, query_prefix: str | None = None,
                passage_prefix: str | None = None, max_length: int | None = None, pooling: str = "auto",
                hnsw_m: int = 32, ef_construction: int = 200, nlist: int | None = None, pq_m: int | None = None,
                train_size: int = 200_000) -> dict:
    import faiss
    from tqdm import tqdm

    if index_type not in INDEX_TYPES:
        raise InputError(f"--index {index_type!r} is not one of {INDEX_TYPES}")
    fingerprint(encoder_path)  # a missing or empty --encoder folder is named now, before the corpus is copied
    n = ensure_docs(corpus, out)
    docs = DocStore(out)
    enc = Encoder(encoder_path, device=device, pooling=pooling, query_prefix=query_prefix,
                  passage_prefix=passage_prefix, max_length=max_length, fp16=fp16)
    ident = {"encoder_fingerprint": fingerprint(encoder_path), **enc.settings(), "shard_size": shard_size,
             "count": n, "store_fp16": fp16}
    emb_dir = out / "emb"
    emb_dir.mkdir(exist_ok=True)
    state = emb_dir / "state.json"
    if state.exists() and json.loads(state.read_text()) != ident:
        raise InputError(f"{emb_dir} holds shards from a build with other settings ({state.read_text().strip()}); "
                           "rerun with the same flags to resume, or pass --overwrite to start over")
    state.write_text(json.dumps(ident) + "\n")

    t0 = time.time()
    paths = encode_shards(enc, docs, emb_dir, shard_size, batch_size, np.float16 if fp16 else np.float32)
    enc_s = time.time() - t0

    index, params = make_faiss_index(enc.dim, n, index_type, fp16, hnsw_m, ef_construction, nlist, pq_m)
    if not index.is_trained:
        # Train on an evenly spaced sample of shards' rows: a prefix would bias toward the corpus's first topic.
        per = max(1, train_size // len(paths))
        sample = []
        for p in paths:
            e = np.load(p, mmap_mode="r")
            sample.append(np.asarray(e[np.linspace(0, len(e) - 1, min(per, len(e))).astype(int)], dtype=np.float32))
        log.info("training %s on %d vectors", index_type, sum(len(s) for s in sample))
        index.train(np.concatenate(sample))
    for p in tqdm(paths, desc=f"adding to {index_type} index", unit="shard"):
        index.add(np.ascontiguousarray(np.load(p), dtype=np.float32))
    tmp = out / "index.faiss.tmp"
    faiss.write_index(index, str(tmp))
    os.replace(tmp, out / "index.faiss")
    return {"kind": "dense", "count": n, "metric": "inner_product", "index_type": index_type, "fp16": fp16,
            "index_params": params, "dim": enc.dim, "encoder_name": model_name(encoder_path),
            "encoder_path": str(Path(encoder_path).resolve()), "encoder_fingerprint": ident["encoder_fingerprint"],
            **enc.settings(), "encode_seconds": round(enc_s, 1)}


def build_index(corpus: str | Path, out: str | Path, kind: str, overwrite: bool = False, keep_shards: bool = True,
                **opts) -> dict:
    """Build (or resume building) an index; returns the manifest written to out/manifest.json."""
    corpus, out = Path(corpus), Path(out)
    if not corpus.exists():
        raise InputFileMissing(f"corpus {corpus} does not exist (run `python scripts/prepare_data.py` for the demo corpus)")
    prepare_out(out, overwrite)
    if kind == "bm25":
        fields = build_bm25(corpus, out, **opts)
    elif kind == "dense":
        fields = build_dense(corpus, out, **opts)
    else:
        raise InputError(f"--kind {kind!r} is not bm25 or dense")
    fields["corpus"] = str(corpus.resolve())
    write_manifest(out, fields)
    if not keep_shards:
        shutil.rmtree(out / "emb", ignore_errors=True)
    return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # what to build
    p.add_argument("--corpus", required=True, help="corpus file: .jsonl ({'id','contents'} a line) or .parquet")
    p.add_argument("--out", required=True, help="index folder to create (resumed if a build there was killed)")
    p.add_argument("--kind", required=True, choices=["bm25", "dense"], help="bm25 (bm25s) or dense (encoder + FAISS)")
    p.add_argument("--overwrite", action="store_true", help="delete a finished or partial index in --out first")
    # bm25
    p.add_argument("--k1", type=float, default=1.5, help="BM25 k1 (term-frequency saturation)")
    p.add_argument("--b", type=float, default=0.75, help="BM25 b (length normalisation)")
    p.add_argument("--method", default="lucene", help="bm25s scoring variant: lucene, robertson, atire, bm25l, bm25+")
    p.add_argument("--stopwords", default="en", help="bm25s stopword list ('en', or '' for none)")
    p.add_argument("--stemmer", default=None, help="PyStemmer language, e.g. 'english' (needs PyStemmer); default none")
    # dense encoder
    p.add_argument("--encoder", help="encoder folder (transformers / sentence-transformers); required for --kind dense")
    p.add_argument("--device", default="cpu", help="torch device for encoding: cpu, cuda, cuda:1")
    p.add_argument("--fp16", action="store_true",
                   help="encode in float16 (CUDA only) and store vectors as float16 in shards and index (half memory)")
    p.add_argument("--batch-size", type=int, default=64, help="passages per encoder forward pass")
    p.add_argument("--shard-size", type=int, default=2000, help="passages per resumable embedding shard (the unit a killed build redoes)")
    p.add_argument("--pooling", default="auto", choices=["auto", "mean", "cls"],
                   help="pooling; auto reads a sentence-transformers folder's config, else mean")
    p.add_argument("--query-prefix", default=None, help="prefix for queries; default 'query: ' for e5 models, else ''")
    p.add_argument("--passage-prefix", default=None, help="prefix for passages; default 'passage: ' for e5 models, else ''")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per text (default: model's, else 512)")
    p.add_argument("--keep-shards", type=int, default=1, choices=[0, 1],
                   help="1 keeps emb/ shards after the build (re-index without re-encoding), 0 deletes them")
    # faiss
    p.add_argument("--index", default="flat", choices=list(INDEX_TYPES), help="FAISS index: exact flat, HNSW graph, IVF-PQ")
    p.add_argument("--hnsw-m", type=int, default=32, help="HNSW neighbours per node")
    p.add_argument("--ef-construction", type=int, default=200, help="HNSW build-time beam width")
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default ~4*sqrt(N))")
    p.add_argument("--pq-m", type=int, default=None, help="PQ sub-quantizers, must divide dim (default dim/8)")
    p.add_argument("--train-size", type=int, default=200_000, help="vectors sampled to train IVF-PQ")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if a.kind == "dense":
        if not a.encoder:
            p.error("--kind dense needs --encoder FOLDER (e.g. the MiniLM folder from utils.assets.minilm_dir())")
        opts = dict(encoder_path=a.encoder, device=a.device, index_type=a.index, fp16=a.fp16, shard_size=a.shard_size,
                    batch_size=a.batch_size, query_prefix=a.query_prefix, passage_prefix=a.passage_prefix,
                    max_length=a.max_length, pooling=a.pooling, hnsw_m=a.hnsw_m, ef_construction=a.ef_construction,
                    nlist=a.nlist, pq_m=a.pq_m, train_size=a.train_size)
    else:
        opts = dict(k1=a.k1, b=a.b, method=a.method, stopwords=a.stopwords, stemmer=a.stemmer)
    try:
        m = build_index(a.corpus, a.out, a.kind, overwrite=a.overwrite, keep_shards=bool(a.keep_shards), **opts)
    except InputError as e:  # the user's corpus, folder or flags; anything else is a bug and keeps its traceback
        return entry_point_error("build_index", e)
    print(f"built {m['kind']} index of {m['count']} docs in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
