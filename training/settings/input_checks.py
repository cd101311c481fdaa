"""Checks of what a user points the trainer at, before anything is loaded: the model path (or hub id), the model
folder (a causal LM, weights that open, a tokenizer) and the trackers of --report_to. Each returns [] or the messages
that say what is wrong and what to do; the settings groups' check() (joined by training/settings/validation.py's
validate_args), training/settings/preflight.py and eval.py collect them. No torch, and no transformers unless a config.json
is of an unusual shape: they run before any import that costs."""

from __future__ import annotations

from pathlib import Path

from utils.trackers import parse_report_to


def model_path_errors(model_path: str) -> list[str]:
    """[] for a local folder, or a hub id ("org/name", where "org" is no local folder) while the hub
    is on (from_pretrained and vLLM download it); else the message that says what to do."""
    import os
    import re
    if Path(model_path).exists():
        return []
    hub_id = (re.fullmatch(r"[\w.-]+/[\w.-]+", model_path) is not None and ".." not in model_path
              and not Path(model_path.split("/")[0]).is_dir())
    off = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""  # as huggingface_hub reads it
    if hub_id and off.upper() in ("1", "ON", "YES", "TRUE"):
        return [f"--model_path {model_path} is not a local folder, and the hub is offline here "
                f"(HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE={off}): download it first (`huggingface-cli download "
                f"{model_path} --local-dir DIR`) and pass --model_path DIR, or switch the hub back on"]
    if not hub_id:
        return [f"--model_path {model_path} does not exist (run `python scripts/prepare_data.py` for the demo model)"]
    return []


def report_to_errors(report_to: str) -> list[str]:
    """[] for a --report_to of known trackers; else the message naming what is not one."""
    try:
        parse_report_to(report_to)
    except ValueError as e:
        return [str(e)]
    return []


# ----------------------------------------------------------------------------- the model folder

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # LlamaForCausalLM, GPT2LMHeadModel: what AutoModelForCausalLM builds
ST_MARKERS = ("modules.json", "config_sentence_transformers.json")  # a sentence-transformers encoder's folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tiktoken.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_folder_errors(model_path: str, flag: str = "--model_path", role: str = "the policy",
                        tokenizer: bool = True) -> list[str]:
    """[] for a local folder that holds a causal LM transformers can build, weights that open (each safetensors
    file whole, as its header says) and, with `tokenizer`, a tokenizer; else what is wrong, naming the file.
    Reads config.json and the weight files' headers only: milliseconds, before any model is loaded. A path that
    is not a local folder is model_path_errors' business (a hub id is fetched at start-up)."""
    import json

    folder = Path(model_path)
    if not folder.is_dir():
        return [f"{flag} {model_path} is a file, not a model folder"] if folder.exists() else []
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return [f"{flag} {model_path} holds no config.json, so it is not an HF model folder (it holds: "
                f"{_listing(folder)})"]
    try:
        cfg = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        return [f"{cfg_file} cannot be read as JSON{where} ({e}); the folder's copy is damaged: download it again"]
    if not isinstance(cfg, dict):
        return [f"{cfg_file} is a JSON {type(cfg).__name__}, not an HF model config"]
    errs = [e for e in [_causal_lm_error(folder, cfg, flag, role)] if e]
    errs += _weight_errors(folder, flag)
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        errs.append(f"{flag} {model_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                    f"tokenizer files of the model it came from into it (AutoTokenizer.save_pretrained)")
    return errs


def _listing(folder: Path, n: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return (", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")) or "nothing"


def _causal_lm_error(folder: Path, cfg: dict, flag: str, role: str) -> str | None:
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    model_type = cfg.get("model_type")
    found = f"{' / '.join(archs) or 'no architecture'} (model_type {model_type})"
    need = (f"{role} must be a causal language model, whose config.json names a *ForCausalLM architecture "
            f"(LlamaForCausalLM, Qwen2ForCausalLM, ...): pass a base or instruct LLM's folder")
    st = [m for m in ST_MARKERS if (folder / m).is_file()]
    if st:
        return (f"{flag} {folder} is a sentence-transformers encoder ({st[0]}), not a causal LM: its config.json "
                f"names {found}; {need}")
    if any(a.endswith(CAUSAL_SUFFIXES) for a in archs):
        return None
    # Rare shapes (no architectures, a *ForConditionalGeneration, custom code): ask transformers' own table. Its
    # import costs seconds, paid only here.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return (f"{flag} {folder}: config.json's model_type {model_type!r} is not one this transformers knows"
                + (" (the model ships its own code, auto_map, which is not run here)" if cfg.get("auto_map") else "")
                + f"; upgrade transformers or pick a supported model. {need}")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if archs and not set(archs) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return f"{flag} {folder} is not a causal LM: its config.json names {found}; {need}"
    if not archs and causal is None:
        return f"{flag} {folder} is not a causal LM: transformers builds no causal LM for model_type {model_type!r}; {need}"
    return None


def _weight_errors(folder: Path, flag: str) -> list[str]:
    """What keeps the weights of `folder` from loading: none there, a shard the index names missing, a file
    shorter than its header says (an interrupted download or copy)."""
    import json

    index = next((folder / f for f in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                  if (folder / f).is_file()), None)
    if index is not None:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{index} cannot be read ({type(e).__name__}: {e}); the folder's copy is damaged: download it again"]
        gone = [f for f in files if not (folder / f).is_file()]
        if gone:
            return [f"{index} names {len(gone)} weight file(s) that are not in {folder}: {', '.join(gone[:4])}"
                    + (", ..." if len(gone) > 4 else "") + "; the download or copy is incomplete"]
    else:
        files = [f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file()]
        if not files:
            gguf = sorted(p.name for p in folder.glob("*.gguf"))
            return [f"{flag} {folder} holds no weights (none of {', '.join(WEIGHT_FILES)})"
                    + (f"; {gguf[0]} is a GGUF file, which is not loaded here: convert it to safetensors "
                       f"(scripts/prepare_data.py does for the demo model)" if gguf else "")]
    return [e for f in files if (e := _weight_file_error(folder / f, folder))]


def _weight_file_error(path: Path, folder: Path) -> str | None:
    import json
    import zipfile

    size = path.stat().st_size
    damaged = f"(an interrupted download or copy): download or copy it again into {folder}"
    if path.suffix == ".safetensors":
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > size - 8:
                return f"{path} is truncated ({size} bytes, not even its header) {damaged}"
            try:
                header = json.loads(fh.read(n))
                end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                return f"{path} is not a safetensors file (its header does not parse) {damaged}"
        if size < 8 + n + end:
            return f"{path} is truncated: {size} bytes, where its header needs {8 + n + end} {damaged}"
        return None
    with open(path, "rb") as fh:
        zipped = fh.read(4) == b"PK\x03\x04"
    if zipped and not zipfile.is_zipfile(path):  # torch.save's zip lost its end (its central directory)
        return f"{path} is truncated ({size} bytes; its zip directory is missing) {damaged}"
    return None
