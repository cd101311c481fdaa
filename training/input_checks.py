"""Checks of what a user points the trainer at, before anything is loaded: the model folder (or hub id) and the
trackers of --report_to. Each returns [] or the messages that say what is wrong and what to do; training/config.py's
validate_args and eval.py collect them. No torch, no transformers: they run before any import that costs."""

from __future__ import annotations

from pathlib import Path


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
    from utils.trackers import parse_report_to  # light: no tracker is imported
    try:
        parse_report_to(report_to)
    except ValueError as e:
        return [str(e)]
    return []
