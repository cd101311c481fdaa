"""In-process retrievers (BM25 and dense) over an index folder built by retrieval.build_index
(or made from Search-R1's prebuilt e5_Flat.index + wiki-18.jsonl by retrieval.import_searchr1).

    r = load_retriever("data/indexes/minilm_flat")            # encoder taken from manifest.json
    r.search(["who wrote hamlet"], topk=3)                    # [[{"id", "contents", "score"}, ...]]
    load_retriever("/idx/e5_wiki18", device="cuda", faiss_gpu=True, faiss_gpus=[6, 7])  # shards on GPUs 6 and 7

For small corpora and tests the retriever lives in the trainer's process; for big ones the same
object sits behind retrieval.server, one per node.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from retrieval.corpus import DocStore
from retrieval.encoder import Encoder
from retrieval.manifest import ManifestError, import_bm25s, index_file, read_manifest, resolve_encoder
from utils.errors import MissingPackage

log = logging.getLogger(__name__)

Hits = list[list[tuple[int, float]]]  # per query: (row in docs.arrow, score), best first


def check_queries(queries) -> list[str]:
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings, got a single str; wrap it: search([query], topk)")
    queries = list(queries)
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise TypeError(f"queries[{i}] is {type(q).__name__}, not str")
    return queries


class Retriever:
    """Common part: doc lookup and result formatting. Subclasses implement search_ids."""

    kind = "base"

    def __init__(self, index_dir: str | Path, manifest: dict):
        self.index_dir = str(index_dir)
        self.manifest = manifest
        self.docs = DocStore(index_dir)
        if len(self.docs) != manifest["count"]:
            raise ManifestError(f"{index_dir}: docs.arrow holds {len(self.docs)} documents but the manifest says "
                             f"{manifest['count']}; the folder mixes two builds, rebuild it with --overwrite")

    def __len__(self) -> int:
        return len(self.docs)

    def _k(self, topk: int) -> int:
        if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
            raise ValueError(f"topk must be a positive int, got {topk!r}")
        return min(int(topk), len(self.docs))  # asking for more than the corpus holds returns the corpus

    def search_ids(self, queries: list[str], topk: int) -> Hits:
        raise NotImplementedError

    def search_ids_mixed(self, queries: list[str], topks: list[int]) -> Hits:
        """Search queries that each carry their own topk (one micro-batch of the server)."""
        groups = defaultdict(list)
        for i, k in enumerate(topks):
            groups[k].append(i)
        out: Hits = [[] for _ in queries]
        for k, idx in groups.items():
            for i, hits in zip(idx, self.search_ids([queries[i] for i in idx], k)):
                out[i] = hits
        return out

    def to_docs(self, hits: Hits) -> list[list[dict]]:
        return [[{**self.docs.get(i), "score": float(s)} for i, s in row] for row in hits]

    def search_mixed(self, queries: list[str], topks: list[int]) -> list[list[dict]]:
        """search() where each query carries its own topk (one server micro-batch)."""
        return self.to_docs(self.search_ids_mixed(queries, topks))

    def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        """The search-backend interface: per query, up to topk {"id", "contents", "score"}, best first."""
        queries = check_queries(queries)
        if not queries:
            return []
        return self.to_docs(self.search_ids(queries, topk))

    def describe(self) -> dict:
        keys = ("kind", "count", "metric", "index_type", "encoder_name", "dim", "query_prefix")
        return {k: self.manifest[k] for k in keys if k in self.manifest}


class BM25Retriever(Retriever):
    kind = "bm25"

    def __init__(self, index_dir: str | Path, manifest: dict):
        super().__init__(index_dir, manifest)

        bm25s = import_bm25s()
        self._bm25s = bm25s
        self.model = bm25s.BM25.load(str(Path(index_dir) / "bm25"), mmap=True, show_progress=False, verbosity=0)
        self.stopwords = manifest["bm25"]["stopwords"] or None
        self.stemmer = make_stemmer(manifest["bm25"]["stemmer"])

    def tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords=self.stopwords, stemmer=self.stemmer,
                                    return_ids=False, show_progress=False)

    def search_ids(self, queries: list[str], topk: int) -> Hits:
        k = self._k(topk)
        res = self.model.retrieve(self.tokenize(queries), k=k, sorted=True, show_progress=False, n_threads=0)
        # A score of 0 means no query term occurs in the document. Lucene (Search-R1's BM25)
        # returns no hit there, and so do we, rather than k arbitrary documents.
        return [[(int(i), float(s)) for i, s in zip(ids, scores) if s > 0]
                for ids, scores in zip(res.documents, res.scores)]


def make_stemmer(name: str | None):
    if not name:
        return None
    try:
        import Stemmer  # PyStemmer, optional
    except ImportError:
        raise MissingPackage(f"this BM25 index was built with stemmer '{name}', which needs PyStemmer "
                          "(`pip install PyStemmer`)") from None
    return Stemmer.Stemmer(name)


class DenseRetriever(Retriever):
    kind = "dense"

    def __init__(self, index_dir: str | Path, manifest: dict, encoder: str | Path | None = None,
                 device: str = "cpu", faiss_gpu: bool = False, nprobe: int | None = None,
                 ef_search: int | None = None, batch_size: int = 16, faiss_gpus: list[int] | None = None,
                 faiss_fp16: bool | None = None):
        super().__init__(index_dir, manifest)
        import faiss

        enc_path = resolve_encoder(manifest, encoder, index_dir)
        self.encoder = Encoder(enc_path, device=device, pooling=manifest["pooling"], normalize=manifest["normalize"],
                               query_prefix=manifest["query_prefix"], passage_prefix=manifest["passage_prefix"],
                               max_length=manifest["max_length"], fp16=manifest.get("fp16", False))
        if self.encoder.dim != manifest["dim"]:
            raise ManifestError(f"encoder {enc_path} gives dim {self.encoder.dim}, index {index_dir} holds dim {manifest['dim']}")
        self.batch_size = batch_size
        path = index_file(index_dir, manifest)  # index.faiss, or an imported index where it lies
        index = faiss.read_index(str(path))
        if index.ntotal != manifest["count"]:
            raise ManifestError(f"{path} holds {index.ntotal} vectors, manifest says {manifest['count']}; rebuild the index")
        params = manifest.get("index_params", {})
        if manifest["index_type"] in ("ivfpq", "ivf"):
            faiss.extract_index_ivf(index).nprobe = nprobe or params.get("nprobe", 32)
        elif manifest["index_type"] == "hnsw":
            index.hnsw.efSearch = ef_search or params.get("ef_search", 128)
        if faiss_gpus is not None:
            faiss_gpu = True  # naming the GPUs asks for them
        if faiss_gpu:
            index = _to_gpus(faiss, index, manifest, gpus=faiss_gpus, fp16=faiss_fp16)
        self.index = index

    def encode(self, queries: list[str]) -> np.ndarray:
        # Sub-batches of 16 after the encoder's length sort: a single padded batch of 64 FanOutQA
        # questions holds 2.7x their real tokens (one long query pads all), 16s hold 1.35x;
        # measured 25-35% faster per query on CPU.
        return self.encoder.encode(queries, is_query=True, batch_size=self.batch_size)  # (Q, dim)

    def search_vectors(self, vecs: np.ndarray, topk: int) -> Hits:
        k = self._k(topk)
        scores, ids = self.index.search(vecs, k)  # (Q, k) each; id -1 pads when fewer than k are found
        return [[(int(i), float(s)) for i, s in zip(ir, sr) if i >= 0] for ir, sr in zip(ids, scores)]

    def search_ids(self, queries: list[str], topk: int) -> Hits:
        return self.search_vectors(self.encode(queries), topk)

    def search_ids_mixed(self, queries: list[str], topks: list[int]) -> Hits:
        # Encoding dominates the cost, so encode the whole micro-batch once and only split
        # the (cheap) FAISS search by topk; a per-topk search keeps results identical to search().
        vecs = self.encode(queries)
        groups = defaultdict(list)
        for i, k in enumerate(topks):
            groups[k].append(i)
        out: Hits = [[] for _ in queries]
        for k, idx in groups.items():
            for i, hits in zip(idx, self.search_vectors(vecs[idx], k)):
                out[i] = hits
        return out


def parse_gpu_ids(spec) -> list[int] | None:
    """The --faiss-gpus value: "0,1" or [0, 1] -> [0, 1]; None, "" or "all" -> None (every visible GPU).

    Ids count the GPUs this process sees, i.e. after CUDA_VISIBLE_DEVICES renumbers them.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "all")):
        return None
    items = [x.strip() for x in spec.split(",")] if isinstance(spec, str) else list(spec)
    try:
        ids = [int(x) for x in items]
    except (TypeError, ValueError):
        raise ValueError(f"GPU list {spec!r} is not comma-separated integers like '0,1'") from None
    if not ids:
        raise ValueError("the GPU list is empty; leave the flag out to use every visible GPU")
    if any(g < 0 for g in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {ids} must hold distinct ids >= 0")
    return ids


def check_gpu_ids(gpus: list[int] | None, visible: int) -> list[int]:
    """The GPU ids the index goes to: `gpus`, or all `visible` ones when None; refuses ids this process cannot see."""
    if gpus is None:
        return list(range(visible))
    gpus = parse_gpu_ids(gpus)
    bad = [g for g in gpus if g >= visible]
    if bad:
        raise ValueError(f"--faiss-gpus {','.join(map(str, gpus))}: GPU {bad[0]} does not exist here; this process "
                         f"sees {visible} GPU(s), numbered 0..{visible - 1} after CUDA_VISIBLE_DEVICES "
                         f"({os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return gpus


def retriever_gpu_bytes(num_vectors: int, dim: int, gpus: list[int], fp16: bool) -> dict[int, int]:
    """Bytes of index vectors `_to_gpus` puts on each chosen GPU, for a flat index sharded over `gpus`.

    FAISS shards a flat index into contiguous slices, shard i holding rows n*i//k .. n*(i+1)//k of the
    k = len(gpus) GPUs, in the order given; a vector takes dim*4 bytes, dim*2 with fp16. So wiki-18
    with e5-base-v2 (21,015,324 x 768) over 2 GPUs: 32.3 GB each in float32, 16.1 GB in fp16.
    Not counted: FAISS's per-GPU scratch pool (StandardGpuResources' temp memory, up to
    FAISS_GPU_TEMP_BYTES = 1.5 GiB a GPU by default), the CUDA context, and the query encoder on
    --device. IVF-PQ indexes hold codes instead (smaller); HNSW stays on the CPU (0 bytes on GPUs).
    """
    gpus = list(gpus)
    if not gpus:
        raise ValueError("gpus is empty: name at least one GPU id")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus {gpus} names a GPU twice")
    if num_vectors < 0 or dim < 1:
        raise ValueError(f"num_vectors must be >= 0 and dim >= 1, got {num_vectors}, {dim}")
    per_vec = dim * (2 if fp16 else 4)
    k = len(gpus)
    return {g: (num_vectors * (i + 1) // k - num_vectors * i // k) * per_vec for i, g in enumerate(gpus)}


FAISS_GPU_TEMP_BYTES = 1536 * 1024 * 1024  # faiss StandardGpuResources' default scratch pool on a GPU over 8 GiB


def _fp16_flat_to_flat(faiss, index):
    """Our --fp16 flat builds are IndexScalarQuantizer(QT_fp16). faiss-gpu clones one to a single GPU, but
    refuses to shard it ("IndexShards implemented only for IndexIVFFlat, ..., IndexFlat and IndexIVFPQ"), so
    for several GPUs it becomes a float32 IndexFlat first (exact: fp16 decodes exactly), copied in blocks;
    the GPUs then store it as fp16 again (useFloat16). Costs a transient float32 copy in host RAM."""
    flat = faiss.IndexFlat(index.d, index.metric_type)
    step = 1 << 20
    for i0 in range(0, index.ntotal, step):
        flat.add(index.reconstruct_n(i0, min(step, index.ntotal - i0)))
    return flat


def _to_gpus(faiss, index, manifest: dict, gpus: list[int] | None = None, fp16: bool | None = None):
    """Shard the index over the GPUs `gpus` (faiss-gpu only); None: every visible GPU.

    fp16=None stores the shards as the manifest says (fp16 builds in float16); True stores float32
    vectors as float16 on the GPUs (half the memory, what Search-R1's --faiss_gpu does).
    Untested on GPU: this repo's CI has none (tests replace the cloner by CPU faiss.IndexShards).
    """
    if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
        raise RuntimeError("faiss_gpu=True but this faiss has no GPU support (install faiss-gpu) or sees no GPU")
    if manifest["index_type"] == "hnsw":
        log.warning("FAISS has no GPU HNSW; keeping the HNSW index on CPU")
        return index
    chosen = check_gpu_ids(gpus, faiss.get_num_gpus())
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True  # split the vectors across GPUs instead of replicating them
    co.useFloat16 = bool(manifest.get("fp16", False) if fp16 is None else fp16)
    if len(chosen) > 1 and isinstance(index, faiss.IndexScalarQuantizer) \
            and index.sq.qtype == faiss.ScalarQuantizer.QT_fp16:
        index = _fp16_flat_to_flat(faiss, index)
        co.useFloat16 = True
    if gpus is None:
        return faiss.index_cpu_to_all_gpus(index, co=co)
    log.info("FAISS index sharded over GPUs %s (of %d visible)", chosen, faiss.get_num_gpus())
    return faiss.index_cpu_to_gpus_list(index, co=co, gpus=chosen)


def load_retriever(index_dir: str | Path, encoder: str | Path | None = None, device: str = "cpu", **kw) -> Retriever:
    """Open a BM25 or dense index folder. `encoder` overrides the manifest's encoder path (same model only)."""
    index_dir = Path(index_dir)
    m = read_manifest(index_dir)
    if m["kind"] == "bm25":
        if encoder is not None:
            raise ManifestError(f"{index_dir} is a BM25 index; it takes no encoder (got {encoder})")
        return BM25Retriever(index_dir, m)
    return DenseRetriever(index_dir, m, encoder=encoder, device=device, **kw)
