"""utils/cpu_dtype.py: the dtype rule, and the CLI that scripts call for it."""

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
