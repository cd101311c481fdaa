"""Dense text encoder: a transformers model + pooling (+ L2 normalisation), e5-style prefixes.

Plain `transformers.AutoModel` is used rather than sentence-transformers' pipeline so that the
same code path serves e5/bge/MiniLM and the pooling is explicit. For a sentence-transformers
folder (one holding modules.json), pooling and normalisation are read from its module configs,
so all-MiniLM-L6-v2 gives the same vectors as `SentenceTransformer(dir).encode(...)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from utils.errors import InputError, InputFileMissing

log = logging.getLogger(__name__)

E5_PREFIXES = ("query: ", "passage: ")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".onnx")


def fingerprint(model_path: str | Path) -> str:
    """A cheap identity of an encoder folder, independent of where the folder lives.

    Hashes config.json plus, for each top-level weight file, its name, size and first/last MiB.
    Two fine-tunes of one architecture share config.json but not their weights, so they differ;
    the same model copied to another path (or machine) keeps its fingerprint.
    """
    p = Path(model_path)
    if not p.is_dir():
        raise InputFileMissing(f"encoder folder {p} does not exist; pass a local model folder (no hub downloads here)")
    h = hashlib.sha256()
    cfg = p / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    weights = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                h.update(fh.read(1 << 20))
    if not weights and not cfg.exists():
        raise InputFileMissing(f"{p} holds neither config.json nor weight files; is it a model folder?")
    return h.hexdigest()[:16]


_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}   # what encode() implements
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


def read_st_config(model_path: str | Path) -> dict:
    """Pooling / normalisation / max length of a sentence-transformers folder ({} if it is not one).

    Only what `Encoder.encode` computes is accepted: a Transformer, one Pooling of CLS or mean, and an
    optional Normalize. Any other pooling mode (max, last token, weighted mean, sqrt-length mean) or module
    (Dense, LayerNorm, ...) is refused by name: read as mean pooling it gave other vectors with no error."""
    p = Path(model_path)
    modules = p / "modules.json"
    if not modules.exists():
        return {}
    out: dict = {"normalize": False}
    for m in json.loads(modules.read_text()):
        kind = str(m.get("type", ""))
        if not kind.endswith(_ST_MODULES):
            raise InputError(f"{modules}: module {kind!r} is not implemented by retrieval.encoder (only "
                             f"Transformer, Pooling and Normalize are); its vectors would be wrong. Encode with "
                             f"sentence_transformers.SentenceTransformer, or use an encoder without it")
        if kind.endswith("Pooling"):
            pc = json.loads((p / m["path"] / "config.json").read_text())
            on = sorted(k for k, v in pc.items() if k.startswith("pooling_mode_") and v)
            unknown = [k for k in on if k not in _ST_POOLING]
            if unknown or len(on) != 1:
                raise InputError(f"{p / m['path'] / 'config.json'}: pooling {on or 'none'} is not supported by "
                                 f"retrieval.encoder, which implements exactly one of {sorted(_ST_POOLING)}; "
                                 f"its vectors would be wrong")
            out["pooling"] = _ST_POOLING[on[0]]
        elif kind.endswith("Normalize"):
            out["normalize"] = True
    sb = p / "sentence_bert_config.json"
    if sb.exists():
        msl = json.loads(sb.read_text()).get("max_seq_length")
        if msl:
            out["max_length"] = int(msl)
    return out


def model_name(model_path: str | Path) -> str:
    """A readable name: the folder, with its parent when the folder itself is generic ('.../e5-base-v2/model')."""
    p = Path(model_path).resolve()
    return f"{p.parent.name}/{p.name}" if p.name.lower() in ("model", "models", "hf", "checkpoint", "main") else p.name


def default_prefixes(model_path: str | Path) -> tuple[str, str]:
    """e5 models were trained with "query: " / "passage: " prefixes; others with none (Search-R1's rule)."""
    return E5_PREFIXES if "e5" in model_name(model_path).lower() else ("", "")


class Encoder:
    """Encode queries and passages into float32 vectors (N, dim)."""

    def __init__(self, model_path: str | Path, device: str = "cpu", pooling: str = "auto",
                 normalize: bool | None = None, query_prefix: str | None = None,
                 passage_prefix: str | None = None, max_length: int | None = None, fp16: bool = False):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.model_path = str(model_path)
        st = read_st_config(model_path)
        self.pooling = st.get("pooling", "mean") if pooling == "auto" else pooling
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling '{self.pooling}' is not supported; use mean or cls")
        self.normalize = st.get("normalize", True) if normalize is None else normalize
        dq, dp = default_prefixes(model_path)
        self.query_prefix = dq if query_prefix is None else query_prefix
        self.passage_prefix = dp if passage_prefix is None else passage_prefix
        self.max_length = max_length or st.get("max_length", 512)
        self.device = torch.device(device)
        self.fp16 = fp16 and self.device.type == "cuda"
        if fp16 and not self.fp16:
            log.info("fp16 encoding needs CUDA; encoding in float32 on %s", device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModel.from_pretrained(model_path)
        model = model.half() if self.fp16 else model.float()
        self.model = model.to(self.device).eval()
        self.dim = int(getattr(model.config, "hidden_size", 0)) or self._probe_dim()

    def _probe_dim(self) -> int:
        return int(self.encode(["probe"], is_query=True).shape[1])

    def settings(self) -> dict:
        """What the manifest records so that the server can rebuild an identical query encoder."""
        return {"pooling": self.pooling, "normalize": self.normalize, "query_prefix": self.query_prefix,
                "passage_prefix": self.passage_prefix, "max_length": self.max_length}

    def encode(self, texts: list[str], is_query: bool, batch_size: int = 64, progress: bool = False,
               on_batch=None) -> np.ndarray:
        """(N, dim) float32. on_batch(n) is called after each forward pass of n texts (for progress bars)."""
        import torch

        prefix = self.query_prefix if is_query else self.passage_prefix
        # Batch texts of similar length together (longest first) so padding wastes little compute;
        # the rows are put back in input order at the end.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        texts = [prefix + texts[i] for i in order]
        out = []
        it = range(0, len(texts), batch_size)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc="encoding", unit="batch", leave=False)
        with torch.inference_mode():
            for s in it:
                enc = self.tokenizer(texts[s:s + batch_size], max_length=self.max_length, padding=True,
                                     truncation=True, return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
                if self.pooling == "cls":
                    emb = hidden[:, 0]
                else:
                    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                emb = emb.float()
                if self.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out.append(emb.cpu().numpy())
                if on_batch is not None:
                    on_batch(len(emb))
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        emb = np.empty((len(texts), out[0].shape[1]), dtype=np.float32)
        emb[order] = np.concatenate(out)
        return emb
