"""manifest.json: what an index folder holds, and the check that pairs it with an encoder.

A dense index is only meaningful with the encoder (and prefixes) that built it: the wrong
encoder returns confident nonsense, not an error. So every loader goes through
`resolve_encoder`, which refuses a mismatch loudly instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from utils.errors import InputError, InputFileMissing

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ManifestError(InputError):
    pass


class EncoderMismatch(ManifestError):
    pass


class IndexFileMissing(ManifestError, InputFileMissing):
    """The FAISS file an index folder's manifest points at is not there."""


# What each kind of index folder must hold beside manifest.json (files; a trailing / is a folder), and the
# manifest fields its loader reads. An imported dense index's FAISS file lies elsewhere (`index_file`).
KIND_FILES = {"bm25": ("docs.arrow", "bm25/"), "dense": ("docs.arrow", "index.faiss")}
KIND_FIELDS = {"bm25": ("count", "bm25"),
               "dense": ("count", "dim", "index_type", "encoder_name", "encoder_path", "encoder_fingerprint",
                         "pooling", "normalize", "query_prefix", "passage_prefix", "max_length")}
REBUILD = "rebuild it (`python -m retrieval.build_index --corpus FILE --out DIR --kind bm25|dense --overwrite`)"


def write_manifest(index_dir: str | os.PathLike, fields: dict) -> Path:
    path = Path(index_dir) / MANIFEST
    data = {"format_version": FORMAT_VERSION, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # a killed build never leaves a half-written manifest
    return path


def read_manifest(index_dir: str | os.PathLike) -> dict:
    path = Path(index_dir) / MANIFEST
    if Path(index_dir).is_file():
        raise ManifestError(
            f"{index_dir} is a file, not an index folder. For Search-R1's prebuilt FAISS index (e5_Flat.index + "
            "wiki-18.jsonl) make a folder for it once: `python -m retrieval.import_searchr1 --index FILE "
            "--corpus wiki-18.jsonl --encoder /models/e5-base-v2 --out DIR`, then pass --index DIR")
    if not path.exists():
        raise ManifestError(f"{path} not found: {index_dir} is not a finished index "
                            "(build one with `python -m retrieval.build_index --corpus FILE --out DIR --kind bm25|dense`)")
    try:
        m = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: byte offset {e.start} is not UTF-8, so it is no manifest we wrote; {REBUILD}") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); the file is damaged "
                            f"(a build killed while it was written, or an edit): {REBUILD}") from None
    if not isinstance(m, dict):
        raise ManifestError(f"{path}: a JSON {type(m).__name__}, not the object a build writes; {REBUILD}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: format_version {m.get('format_version')} is not {FORMAT_VERSION}; rebuild the index")
    if m.get("kind") not in ("bm25", "dense"):
        raise ManifestError(f"{path}: unknown kind {m.get('kind')!r} (expected 'bm25' or 'dense'); {REBUILD}")
    check_folder(index_dir, m)
    return m


def check_folder(index_dir: str | os.PathLike, m: dict) -> None:
    """Refuse a manifest whose kind does not match its folder: the files and fields that kind needs, named."""
    kind, folder = m["kind"], Path(index_dir)
    files = [f for f in KIND_FILES[kind] if not (kind == "dense" and f == "index.faiss" and m.get("index_file"))]
    gone = [f for f in files if not (folder / f.rstrip("/")).exists()]
    fields = [k for k in KIND_FIELDS[kind] if k not in m]
    if not gone and not fields:
        return
    other = "dense" if kind == "bm25" else "bm25"
    looks = [f for f in KIND_FILES[other] if f not in KIND_FILES[kind] and (folder / f.rstrip("/")).exists()]
    raise ManifestError(
        f"{folder / MANIFEST} says kind {kind!r}, but " + " and ".join(
            ([f"the folder lacks {', '.join(gone)}"] if gone else [])
            + ([f"the manifest lacks the field(s) {', '.join(fields)}"] if fields else []))
        + f" (a {kind} index needs {', '.join(KIND_FILES[kind])}"
        + (f"; the folder holds {', '.join(looks)}, a {other} index's files: the manifest belongs to another index"
           if looks else "") + f"); {REBUILD}")


def index_file(index_dir: str | os.PathLike, manifest: dict) -> Path:
    """The FAISS file of a dense index: index.faiss in the folder, or the file an imported index points at
    (manifest "index_file", e.g. Search-R1's multi-GB e5_Flat.index, which is read in place, not copied)."""
    name = manifest.get("index_file") or "index.faiss"
    path = Path(index_dir) / name  # an absolute index_file stays as it is
    if not path.exists():
        raise IndexFileMissing(f"{path} not found: the FAISS index of {index_dir} "
                                + ("has moved; rerun retrieval.import_searchr1 with its new --index"
                                   if manifest.get("index_file") else "is missing; rebuild with --overwrite"))
    return path


def resolve_encoder(manifest: dict, encoder: str | os.PathLike | None, index_dir: str | os.PathLike) -> str:
    """Return the encoder folder to use with a dense index, refusing one that did not build it.

    encoder=None takes the folder recorded at build time. A different folder is accepted only
    when its fingerprint (config + weights) equals the recorded one, e.g. the same model copied
    to another machine.
    """
    from retrieval.encoder import fingerprint

    want_fp = manifest["encoder_fingerprint"]
    if encoder is None:
        path = manifest["encoder_path"]
        if not Path(path).is_dir():
            raise ManifestError(
                f"index {index_dir} was built with encoder '{manifest['encoder_name']}' at {path}, which does not exist "
                "here; pass the same model's folder with --encoder / encoder=...")
    else:
        path = str(encoder)
    got_fp = fingerprint(path)
    if got_fp != want_fp:
        raise EncoderMismatch(
            f"encoder {path} (fingerprint {got_fp}) is not the encoder that built index {index_dir}: "
            f"'{manifest['encoder_name']}' (fingerprint {want_fp}, dim {manifest['dim']}, "
            f"query prefix {manifest['query_prefix']!r}). Query vectors from another encoder would "
            "silently return wrong documents; use the recorded encoder or rebuild the index with yours.")
    return path


def check_index(index_dir: str | os.PathLike) -> dict:
    """A finished index whose manifest fits its folder, with a dense index's encoder and FAISS file at hand; its
    manifest. Nothing is loaded. The one check train.py's preflight, eval.py and dataprep.check_inputs make;
    InputError (ManifestError, IndexFileMissing, EncoderMismatch) naming what is wrong otherwise."""
    m = read_manifest(index_dir)
    if m["kind"] == "dense":
        resolve_encoder(m, None, index_dir)
        index_file(index_dir, m)
    return m


def import_bm25s():
    """bm25s, imported so that it leaves the GPUs alone.

    bm25s.selection runs a jax.lax.top_k at import when JAX is installed; on a CUDA machine JAX then
    preallocates 75% of the first GPU (XLA's default) in every process that loads a BM25 index. Seen
    on an H100 (scripts/gpu_check.sh): the training rank died out of memory beside a 60 GiB JAX pool.
    BM25's top-k runs on numpy arrays anyway, so JAX is kept on the CPU unless the user chose.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import bm25s

    return bm25s
