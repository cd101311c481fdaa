"""scripts/demo_cpu.sh: it starts SSP from an SFT cold start made by the script the learning proof
runs too (scripts/sft_coldstart.sh), and a second run of it reuses what the first one left: the SFT
export is kept, training resumes from the latest checkpoint, and the eval is redone (--overwrite).

The end-to-end test runs the real demo at a smoke scale (1 then 2 SSP steps of 2 proposer prompts, 2 eval rows
per file) from the session's smoke SFT (tests/conftest.py, smoke_sft: scripts/sft_coldstart.sh on 8 demos in one
step from a tiny random Llama, shared with the ladder's test), handed to the demo as SFT_DIR: about 2 minutes on
2 cores. It needs the .venv of scripts/setup_cpu.sh, which the demo calls first and which returns at once when it
is installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "scripts" / "demo_cpu.sh"
PROOF = REPO / "scripts" / "learning_proof_cpu.sh"
SFT = REPO / "scripts" / "sft_coldstart.sh"


@pytest.mark.parametrize("script", [DEMO, PROOF, SFT], ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sft_cold_start_is_one_shared_script():
    """The demo and the learning proof both call sft_coldstart.sh; neither runs the SFT (python -m training.loop.sft) itself."""
    sft = r"^[^#\n]*(training/loop/sft\.py|-m training\.loop\.sft)"
    for script in (DEMO, PROOF):
        text = script.read_text()
        assert re.search(r"^[^#\n]*bash scripts/sft_coldstart\.sh", text, re.M), script.name
        assert not re.search(sft, text, re.M), script.name
    assert re.search(sft, SFT.read_text(), re.M)


def test_demo_trains_from_the_sft_export_with_the_learning_proof_protocol():
    """The demo's recipe is scripts/recipe.sh's (which tests/test_own_data_script.py holds equal to the ladder's
    defaults, game setting by game setting); here: the demo uses it, with the ladder's rollout protocol."""
    from tests.recipe_protocol import script_protocol
    demo, proof, recipe = DEMO.read_text(), PROOF.read_text(), (REPO / "scripts" / "recipe.sh").read_text()
    assert '--model_path "$SFT_DIR/hf"' in demo
    assert re.search(r"^source scripts/recipe\.sh$", demo, re.M)
    proto = re.compile(r"^PROTO=\((.*)\)$", re.M)
    assert proto.search(recipe).group(1) == proto.search(proof).group(1)
    for flag in ("--train_top_layers 8", "--old_logprobs rollout", '"${PROTO[@]}"'):
        assert flag in recipe and flag in proof, flag
    for arrays in ('"${RL_CPU[@]}" "${GAME[@]}" "${GAME_CPU[@]}"', '"${EVAL_CPU[@]}"'):
        assert arrays in demo, arrays
    assert '--dtype "$DTYPE"' in demo and '--dtype "$DTYPE"' in proof
    # the same game: the ladder's defaults (issue 31)
    assert script_protocol(DEMO) == script_protocol(PROOF)
    assert not re.search(r"^[^#\n]*--(rag_verify|min_searches|proposer_reward) ", demo, re.M)  # spelt once, in recipe.sh
    for script in (demo, proof):  # the dtype is measured on the machine at hand, not a constant, once per run folder
        assert re.search(r'utils\.cpu_dtype --verbose --keep_in "\$OUT"', script)
    assert "--overwrite" in demo.split("eval.py", 1)[1]  # a re-run re-evaluates into the same folder


def _run_demo(env: dict, log: Path) -> str:
    t0 = time.time()
    r = subprocess.run(["bash", str(DEMO)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=900)
    log.write_text(r.stdout)
    assert r.returncode == 0, f"demo_cpu.sh exited {r.returncode} after {time.time() - t0:.0f} s:\n{r.stdout[-6000:]}"
    return r.stdout


@pytest.mark.slow
def test_demo_smoke_runs_and_reruns(tmp_path, smoke_sft):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the .venv of scripts/setup_cpu.sh")
    from utils.dist import free_port

    out = tmp_path / "demo"
    env = {**os.environ, "OUT": str(out), "PORT": str(free_port()), "SFT_DIR": str(smoke_sft), "STEPS": "1", "PROMPTS": "2", "EVAL_LIMIT": "2", "MAX_TOKENS_PER_TURN": "16",
           "NPROC": "1",  # one core per pytest worker (scripts/test.sh runs two)
           "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions")}
    env.pop("DTYPE", None)  # measured, then kept in OUT/dtype: the rerun below checks that

    # first run: the SFT export given (SFT_DIR) is taken as it is, then SSP from it to step 1 (leg 2 has nothing
    # left to do), then the eval
    first = _run_demo(env, tmp_path / "first.log")
    assert "SFT cold start: skipped" in first and "-- SFT:" not in first
    hf = smoke_sft / "hf"
    assert json.loads((out / "config.json").read_text())["model"]["model_path"] == str(hf)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert "leg 2: skipped" in first
    res = json.loads((out / "eval" / "results.json").read_text())
    assert res["overall"]["n"] == 8  # 2 rows of each of the 4 eval files
    assert res["settings"]["max_tokens_per_turn"]["value"] == 16   # MAX_TOKENS_PER_TURN reached the eval
    assert json.loads((out / "config.json").read_text())["rollout"]["max_tokens_per_turn"] == 16   # and training
    assert {"reading_heldout", "twohop_heldout"} <= set(res["per_source"])
    assert "questions answered" in first
    # the demo mix the SFT trained on fits the demo's own rollout protocol, demo by demo (issue 31)
    from transformers import AutoTokenizer

    from tests.recipe_protocol import misfits, script_protocol
    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "SmolLM2-135M-Instruct")
    assert not misfits(REPO / "data" / "train" / "coldstart_mix.jsonl", script_protocol(DEMO), tok)
    sft_mtime = (hf / "config.json").stat().st_mtime

    # second run, one step further: the SFT export is reused, leg 1 is skipped, leg 2 resumes from
    # step 1, and the eval goes into the same folder again
    # the dtype the first run measured is the one the resume uses (a second measurement may land elsewhere)
    first_dtype = (out / "dtype").read_text().strip()
    assert json.loads((out / "config.json").read_text())["model"]["dtype"] == first_dtype
    env["STEPS"], env["PORT"] = "2", str(free_port())
    second = _run_demo(env, tmp_path / "second.log")
    assert f"cpu_dtype: {first_dtype}, kept from the run in {out}" in second
    assert "SFT cold start: skipped" in second and "-- SFT:" not in second
    assert (hf / "config.json").stat().st_mtime == sft_mtime
    assert "leg 1: skipped" in second
    assert "leg 2: resume from the checkpoint at step 1" in second
    assert "resumed from" in second  # train.py's own line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    steps = {json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {1, 2} <= steps
    res2 = json.loads((out / "eval" / "results.json").read_text())
    assert res2["overall"]["n"] == 8
    assert json.loads((out / "eval" / "config.json").read_text())["model"].endswith("step_000002/hf")
    stages = [line.split("\t")[0] for line in (out / "timings.tsv").read_text().splitlines()]
    assert stages.count("eval") == 2 and stages.count("ssp_leg2") == 1
