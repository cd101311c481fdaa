"""Serve Search-R1's prebuilt retrieval assets as they are: make an index folder for e5_Flat.index + wiki-18.jsonl.

    python -m retrieval.import_searchr1 --index /data/searchr1/e5_Flat.index \
        --corpus /data/searchr1/wiki-18.jsonl --encoder /models/e5-base-v2 --out data/indexes/e5_wiki18
    python -m retrieval.server --index data/indexes/e5_wiki18 --device cuda --faiss-gpus 0,1 --faiss-fp16

Search-R1 (github.com/PeterGriffinJin/Search-R1, search_r1/search/index_builder.py and
retrieval_server.py) ships a FAISS index whose row i is line i of the JSONL corpus
({"id", "contents": "\"Title\"\\ntext"}), built by faiss.index_factory(dim, "Flat", METRIC_INNER_PRODUCT)
over e5-base-v2 vectors: "passage: " + contents, max 256 tokens, mean pooling over the attention
mask, L2-normalised; queries get "query: ". This command writes into --out:

  * manifest.json: those encoder settings, the encoder's fingerprint, and "index_file", the absolute
    path of their index. The multi-GB index is read where it lies, never copied or linked, so
    moving it means rerunning this command (the loader says so).
  * docs.arrow: the corpus as our memory-mapped doc store (a 21M-passage corpus costs page cache, not
    Python objects). Search-R1's server makes the same conversion (datasets.load_dataset('json')
    writes an Arrow cache) on its first start.

Nothing is re-encoded. Two checks run first, because a wrong pairing returns confident nonsense
rather than an error: the index must hold one vector per corpus line, of the encoder's dim; and for
a flat index, --check-docs passages spread over the corpus are encoded here and compared with the
vectors stored at their rows (read straight from the file; the index is not loaded). A different
model, prefix, pooling or corpus order gives cosines well under --min-cosine (0.995; the same model in
fp16 vs fp32 agrees to ~0.9999). --check-docs 0 skips it.

The retriever name (Search-R1's --retriever_name, which picks the prefixes) is taken from the index
file name, "e5_Flat.index" -> "e5" (index_builder.py names files {method}_{faiss_type}.index);
--retriever-name overrides it.
"""

from __future__ import annotations

import argparse
import logging
import struct
import sys
from pathlib import Path

import numpy as np

from retrieval.build_index import ensure_docs, prepare_out
from retrieval.corpus import DocStore
from retrieval.encoder import Encoder, fingerprint, model_name
from retrieval.manifest import EncoderMismatch, write_manifest
from utils.errors import InputError, InputFileMissing, entry_point_error

log = logging.getLogger("retrieval.import_searchr1")

# retrieval_server.py serves with retrieval_query_max_length=256; build_index.sh encodes passages with --max_length 256
SEARCHR1_MAX_LENGTH = 256
BGE_QUERY_PREFIX = "Represent this sentence for searching relevant passages: "

# FAISS index files start with a fourcc naming the class, then (for the usual classes) the header
# d:int32, ntotal:int64, two int64 placeholders, is_trained:uint8, metric_type:int32 (faiss/impl/index_write.cpp).
_HEADER = struct.Struct("<iqqq?i")
_FLAT = {b"IxFI": "inner_product", b"IxF2": "l2", b"IxFl": None}  # IndexFlatIP, IndexFlatL2, IndexFlat(metric)
_METRICS = {0: "inner_product", 1: "l2"}


class SearchR1ImportError(InputError):
    """The index and corpus do not fit together (count, dim, or file layout)."""


def read_faiss_header(path: str | Path) -> dict:
    """fourcc, dim, ntotal and metric of a FAISS index file, read from its first bytes (no index load).

    Works for the flat, HNSW, IVF and scalar-quantizer files faiss writes; for a flat file also the byte
    offset where its float32 rows begin.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4 + _HEADER.size + 4 + 8)
    if len(head) < 4 + _HEADER.size:
        raise SearchR1ImportError(f"{path} is too short to be a FAISS index")
    fourcc = head[:4]
    d, ntotal, _, _, _, metric = _HEADER.unpack_from(head, 4)
    if d <= 0 or ntotal < 0 or metric not in range(0, 30):
        raise SearchR1ImportError(f"{path} does not look like a FAISS index file (fourcc {fourcc!r}, d {d}, ntotal {ntotal})")
    pos = 4 + _HEADER.size + (4 if metric > 1 else 0)  # metric_arg follows for the metrics past L2
    out = {"fourcc": fourcc.decode("latin-1"), "dim": d, "ntotal": ntotal,
           "metric": _METRICS.get(metric, f"faiss_metric_{metric}"), "rows_offset": None}
    if fourcc in _FLAT and len(head) >= pos + 8:
        (n_floats,) = struct.unpack_from("<Q", head, pos)  # the codes vector's size, counted in 4-byte words
        if n_floats == d * ntotal:
            out["rows_offset"] = pos + 8
    return out


def index_type_of(fourcc: str) -> str:
    """Our manifest's index_type for a FAISS fourcc: flat / hnsw / ivf / the fourcc itself."""
    if fourcc.encode("latin-1") in _FLAT:
        return "flat"
    if fourcc.startswith("IHN"):
        return "hnsw"
    if fourcc.startswith(("Iw", "IvF", "IvP", "IvS")):
        return "ivf"
    return fourcc


def read_flat_rows(path: str | Path, header: dict, rows: list[int]) -> np.ndarray:
    """The stored float32 vectors of `rows` of a flat index file, by seeking (nothing else is read)."""
    d, off = header["dim"], header["rows_offset"]
    out = np.empty((len(rows), d), dtype=np.float32)
    with open(path, "rb") as f:
        for k, r in enumerate(rows):
            f.seek(off + int(r) * d * 4)
            out[k] = np.frombuffer(f.read(d * 4), dtype="<f4")
    return out


def searchr1_settings(retriever_name: str) -> dict:
    """The query encoder Search-R1's retrieval_server.py builds for --retriever_name (Encoder.encode)."""
    name = retriever_name.lower()
    qp, pp = "", ""
    if "e5" in name:
        qp, pp = "query: ", "passage: "
    if "bge" in name:
        qp = BGE_QUERY_PREFIX
    return {"pooling": "mean", "normalize": "dpr" not in name, "query_prefix": qp, "passage_prefix": pp,
            "max_length": SEARCHR1_MAX_LENGTH}


def retriever_name_of(index_path: str | Path) -> str:
    """'e5_Flat.index' -> 'e5' (index_builder.py writes {retrieval_method}_{faiss_type}.index)."""
    stem = Path(index_path).name.split(".")[0]
    return stem.rsplit("_", 1)[0] if "_" in stem else stem


def check_rows(encoder, docs, index_path: Path, header: dict, n_check: int, min_cosine: float) -> dict:
    """Encode n_check passages spread over the corpus and compare them with the vectors at their rows."""
    n = header["ntotal"]
    rows = sorted({int(r) for r in np.linspace(0, n - 1, min(n_check, n))})
    stored = read_flat_rows(index_path, header, rows)
    ours = encoder.encode([docs.get(r)["contents"] for r in rows], is_query=False, batch_size=16)
    na, nb = np.linalg.norm(stored, axis=1), np.linalg.norm(ours, axis=1)
    cos = (stored * ours).sum(1) / np.maximum(na * nb, 1e-12)
    worst = int(np.argmin(cos))
    norm_ratio = float(np.max(np.abs(na / np.maximum(nb, 1e-12) - 1)))
    res = {"rows": rows, "min_cosine": round(float(cos.min()), 6), "max_norm_diff": round(norm_ratio, 6)}
    if cos.min() < min_cosine or norm_ratio > 0.01:
        raise EncoderMismatch(
            f"the encoder does not reproduce the vectors stored in {index_path}: row {rows[worst]} "
            f"(doc id {docs.get(rows[worst])['id']}) has cosine {cos[worst]:.4f} with our encoding (need >= {min_cosine}), "
            f"norms differ by up to {norm_ratio:.1%}. Encoder {encoder.model_path} with {encoder.settings()} is not "
            "what built this index, or the corpus is not the one it was built from (row i = line i). Fix "
            "--encoder / --retriever-name / --query-prefix / --passage-prefix / --pooling, or pass --check-docs 0 "
            "to import anyway")
    return res


def import_searchr1(index: str | Path, corpus: str | Path, encoder: str | Path, out: str | Path, *,
                    retriever_name: str | None = None, query_prefix: str | None = None,
                    passage_prefix: str | None = None, pooling: str | None = None, max_length: int | None = None,
                    check_docs: int = 16, min_cosine: float = 0.995, device: str = "cpu",
                    overwrite: bool = False) -> dict:
    """Write out/manifest.json and out/docs.arrow for a Search-R1 index + corpus; returns the manifest."""
    index, corpus, out = Path(index).resolve(), Path(corpus).resolve(), Path(out)
    for what, p in (("--index", index), ("--corpus", corpus)):
        if not p.is_file():
            raise InputFileMissing(f"{what} {p} is not a file")
    fingerprint(encoder)  # a missing --encoder folder is named here, not by transformers' loader
    header = read_faiss_header(index)
    index_type = index_type_of(header["fourcc"])
    name = retriever_name or retriever_name_of(index)
    s = searchr1_settings(name)
    for k, v in (("query_prefix", query_prefix), ("passage_prefix", passage_prefix), ("pooling", pooling),
                 ("max_length", max_length)):
        if v is not None:
            s[k] = v
    enc = Encoder(encoder, device=device, **s)
    if enc.dim != header["dim"]:
        raise SearchR1ImportError(f"{index} holds {header['dim']}-d vectors but encoder {encoder} gives {enc.dim}-d ones: "
                           "not the encoder that built it (Search-R1's e5_Flat.index needs e5-base-v2, 768-d)")

    prepare_out(out, overwrite)
    n = ensure_docs(corpus, out)  # resumable: a rerun over the same corpus reuses docs.arrow
    if n != header["ntotal"]:
        raise SearchR1ImportError(f"{index} holds {header['ntotal']} vectors but {corpus} has {n} documents; index row i "
                           "must be corpus line i, so they are not a pair (wiki-18 has 21,015,324 of each)")
    check = None
    if check_docs > 0:
        if header["rows_offset"] is None:
            log.warning("%s is a %s index (fourcc %s): its rows cannot be read without loading it, so the "
                        "encoder check is skipped", index, index_type, header["fourcc"])
        else:
            check = check_rows(enc, DocStore(out), index, header, check_docs, min_cosine)
            log.info("encoder check passed on %d rows: min cosine %.5f", len(check["rows"]), check["min_cosine"])
    fields = {"kind": "dense", "count": n, "metric": header["metric"], "index_type": index_type, "fp16": False,
              "index_params": {}, "dim": enc.dim, "encoder_name": model_name(encoder),
              "encoder_path": str(Path(encoder).resolve()), "encoder_fingerprint": fingerprint(encoder),
              **enc.settings(), "index_file": str(index), "corpus": str(corpus),
              "imported_from": {"format": "search-r1", "retriever_name": name, "fourcc": header["fourcc"],
                                "check": check}}
    write_manifest(out, fields)
    return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="Search-R1's FAISS file, e.g. e5_Flat.index (read in place)")
    p.add_argument("--corpus", required=True, help="its corpus, e.g. wiki-18.jsonl (row i of the index = line i)")
    p.add_argument("--encoder", required=True, help="local folder of the encoder that built it (intfloat/e5-base-v2)")
    p.add_argument("--out", required=True, help="index folder to write (manifest.json + docs.arrow)")
    p.add_argument("--retriever-name", default=None,
                   help="Search-R1's --retriever_name (picks the prefixes: e5, bge, dpr); default from the "
                        "index file name, e5_Flat.index -> e5")
    p.add_argument("--query-prefix", default=None, help="override the query prefix ('query: ' for e5)")
    p.add_argument("--passage-prefix", default=None, help="override the passage prefix ('passage: ' for e5)")
    p.add_argument("--pooling", default=None, choices=["mean", "cls"], help="override the pooling (Search-R1: mean)")
    p.add_argument("--max-length", type=int, default=None, help=f"max tokens per text (Search-R1: {SEARCHR1_MAX_LENGTH})")
    p.add_argument("--check-docs", type=int, default=16,
                   help="passages re-encoded and compared with their stored vectors (flat indexes; 0 skips)")
    p.add_argument("--min-cosine", type=float, default=0.995, help="least cosine the check accepts")
    p.add_argument("--device", default="cpu", help="torch device for the check's encoding")
    p.add_argument("--overwrite", action="store_true", help="replace an existing folder made by this or build_index")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        m = import_searchr1(a.index, a.corpus, a.encoder, a.out, retriever_name=a.retriever_name,
                            query_prefix=a.query_prefix, passage_prefix=a.passage_prefix, pooling=a.pooling,
                            max_length=a.max_length, check_docs=a.check_docs, min_cosine=a.min_cosine,
                            device=a.device, overwrite=a.overwrite)
    except InputError as e:  # the user's files or flags; anything else is a bug and keeps its traceback
        return entry_point_error("import_searchr1", e)
    print(f"{a.out}: {m['count']} docs, {m['index_type']} index {m['index_file']} (not copied), encoder "
          f"{m['encoder_name']} with query prefix {m['query_prefix']!r}. Serve it with:\n"
          f"  python -m retrieval.server --index {a.out} --device cuda --faiss-gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
