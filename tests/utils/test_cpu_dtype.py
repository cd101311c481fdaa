"""utils/cpu_dtype.py: the dtype rule, and the CLI that scripts call for it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from utils.cpu_dtype import choose

ROOT = Path(__file__).resolve().parents[2]


def test_choose_needs_a_clear_bf16_gain():
    assert choose(170.0, 666.0) == "bf16"     # the AMX Xeon of docs/PLATFORM_NOTES.md, CPU dtype: ~4x
    assert choose(200.0, 210.0) == "fp32"     # AVX2-only EPYC: bf16 no faster
    assert choose(100.0, 149.0) == "fp32" and choose(100.0, 150.0) == "bf16"
    assert choose(100.0, 120.0, min_gain=1.1) == "bf16"
    with pytest.raises(ValueError, match="positive"):
        choose(0.0, 10.0)


@pytest.mark.parametrize("form,allowed", [("train", {"bf16", "fp32"}), ("eval", {"bfloat16", "float32"})])
def test_cli_prints_one_dtype_in_the_callers_spelling(form, allowed):
    out = subprocess.run([sys.executable, "-m", "utils.cpu_dtype", "--form", form, "--verbose"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() in allowed
    assert "GFLOP/s" in out.stderr


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "utils.cpu_dtype", "--verbose", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_keep_in_measures_once_then_reuses_the_run_folders_answer(tmp_path):
    """CI measured fp32 for a demo's first leg and bf16 for its resume, and train.py refused to mix the two runs:
    a run folder's first answer is kept, and a rerun prints it without measuring again."""
    run = tmp_path / "run"
    first = _cli("--keep_in", str(run))
    assert first.returncode == 0 and "GFLOP/s" in first.stderr  # measured
    assert (run / "dtype").read_text().strip() == first.stdout.strip()
    other = "fp32" if first.stdout.strip() == "bf16" else "bf16"
    (run / "dtype").write_text(other + "\n")  # as if the first measurement had landed on the other side
    again = _cli("--keep_in", str(run))
    assert again.returncode == 0 and again.stdout.strip() == other
    assert "GFLOP/s" not in again.stderr and "kept from the run" in again.stderr
    ev = _cli("--keep_in", str(run), "--form", "eval")
    assert ev.stdout.strip() == {"bf16": "bfloat16", "fp32": "float32"}[other]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_keep_in_follows_a_train_config_already_in_the_folder(tmp_path, dtype):
    """A run started before DIR/dtype existed: its config.json's model.dtype decides, so its resume is not refused."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"dtype": dtype}}))
    out = _cli("--keep_in", str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == dtype and "GFLOP/s" not in out.stderr


def test_keep_in_refuses_a_dtype_file_it_cannot_read(tmp_path):
    (tmp_path / "dtype").write_text("float16\n")
    out = _cli("--keep_in", str(tmp_path))
    assert out.returncode != 0 and "float16" in out.stderr and "delete it" in out.stderr
