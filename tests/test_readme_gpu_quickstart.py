"""Every command of the README's GPU quick start, run as written on a CPU.

The variables the README asks a user to set get small stand-ins: a 40-passage e5_Flat.index + wiki-18.jsonl
in Search-R1's layout (all-MiniLM-L6-v2 standing in for e5-base-v2, encoded as Search-R1 encodes), the tiny
random model, a localhost hostfile of 8 slots (the launcher's dry run at 8 GPUs), a tiny finished run for the
eval. Where the README itself says DRY_RUN=1 (the commands that need GPUs) the script checks and prints
instead of serving or training. The setup script runs with PRINT=1 (installing a GPU stack is not possible
here), and the virtualenv it would make is a stand-in: a folder whose python is this one, logging each call,
so a step that runs another python (scripts/eval.sh once ran .venv's, whatever was active) is seen. Nothing
else is changed: a new line in the block is run as it stands.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from utils.dist import free_port

REPO = Path(__file__).resolve().parents[1]


def quickstart_block() -> str:
    text = (REPO / "README.md").read_text()
    sec = text[text.index("## Quick start on GPUs"):]
    m = re.search(r"```bash\n(.*?)```", sec, re.S)
    assert m, "the GPU quick start has no bash block"
    return m.group(1)


def _searchr1_assets(d: Path, minilm: str) -> None:
    """e5_Flat.index + wiki-18.jsonl as Search-R1's index_builder.py writes them ("passage: " prefix, mean
    pooling, L2-normalised, inner-product Flat)."""
    import faiss
    from sentence_transformers import SentenceTransformer

    rows = [json.loads(line) for _, line in zip(range(40), (REPO / "data/corpus/wiki.jsonl").open())]
    rows = [{"id": str(i), "contents": '"{}"\n{}'.format(*r["contents"].split("\n", 1))} for i, r in enumerate(rows)]
    (d / "wiki-18.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    emb = SentenceTransformer(minilm, device="cpu").encode(["passage: " + r["contents"] for r in rows],
                                                          normalize_embeddings=True).astype("float32")
    index = faiss.index_factory(emb.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(emb)
    faiss.write_index(index, str(d / "e5_Flat.index"))


def _standin_venv(d: Path) -> tuple[Path, Path]:
    """(a virtualenv folder as scripts/setup_gpu.sh leaves it, the log of its python's calls): bin/python and
    bin/python3 run this interpreter and append their arguments to the log; bin/activate puts bin/ first on PATH."""
    venv, log = d / "venv-gpu", d / "venv-gpu.log"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "python3"):
        (venv / "bin" / name).write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH="{venv}/bin:$PATH"\n')
    return venv, log


def _tiny_run(d: Path, model: Path, env: dict) -> Path:
    """A finished one-step run folder with an HF export, as a user's run folder looks after training."""
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(line for _, line in zip(range(60), (REPO / "data/corpus/wiki.jsonl").open())))
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(corpus), "--out", str(d / "bm25"),
                    "--kind", "bm25"], cwd=REPO, env=env, check=True, capture_output=True)
    rows = d / "rows.jsonl"
    rows.write_text("".join(json.dumps({"answer": json.loads(line)["contents"].split("\n")[0], "search_turns": 1}) + "\n"
                            for line in corpus.read_text().splitlines()[:8]))
    run = d / "run"
    r = subprocess.run([sys.executable, "train.py", "--model_path", str(model), "--dtype", "fp32",
                        "--gradient_checkpointing", "false", "--train_data", str(rows), "--index", str(d / "bm25"),
                        "--prompts_per_step", "1", "--solver_n", "2", "--total_steps", "1", "--max_turns", "2",
                        "--min_searches", "1", "--max_tokens_per_turn", "16", "--max_total_tokens", "512",
                        "--max_model_len", "1024", "--micro_token_budget", "1024", "--save_every", "1",
                        "--export_hf", "true", "--tensorboard", "false", "--sample_every", "0", "--output_dir", str(run)],
                       cwd=REPO, env=dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=str(free_port())),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_gpu_quickstart_command_runs(tmp_path, tiny_model_dir):
    from utils.assets import minilm_dir

    block = quickstart_block()
    port = str(free_port())
    env = dict(os.environ, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    sr1 = tmp_path / "searchr1"
    sr1.mkdir()
    _searchr1_assets(sr1, str(minilm_dir()))
    run = _tiny_run(tmp_path, tiny_model_dir, env)
    (tmp_path / "hostfile").write_text("localhost slots=8\n")
    venv, calls = _standin_venv(tmp_path)
    env.pop("VIRTUAL_ENV", None)
    env.update(VENV=str(venv), PRINT="1",                       # setup_gpu.sh: print; `source` the stand-in
               SR1=str(sr1), E5=str(minilm_dir()), IDX=str(tmp_path / "e5_wiki18"), JUDGE=str(tiny_model_dir),
               MODEL=str(tiny_model_dir), ROWS=str(tmp_path / "rows.jsonl"), HOSTFILE=str(tmp_path / "hostfile"),
               RUN=str(run), LAUNCHER_ARGS=f"--no_ssh_check --master_addr 127.0.0.1 --master_port {free_port()}",
               OUT=str(tmp_path / "train_out"), LIMIT="2", OUT_DIR=str(tmp_path / "eval"))
    # the one change to the text: the retriever's port, which must be free on this machine
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block.replace("8000", port)
    (tmp_path / "quickstart.sh").write_text(script)
    r = subprocess.run(["bash", str(tmp_path / "quickstart.sh")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "install -r requirements.txt" in out and "flash-attn==" in out             # 0. the install order
    assert (tmp_path / "e5_wiki18" / "manifest.json").exists()                          # 2. the import
    assert "start_judge.sh: would run" in out                                           # 3. the judge
    assert "dry run: ok" in out and "memory plan" in out.lower()                        # 4. 8 slots, dry run
    res = json.loads((tmp_path / "eval" / "results.json").read_text())                  # 5. the eval
    assert res["settings"], res.keys()
    ran = calls.read_text()                                                             # all on the GPU venv's python
    assert "scripts/prepare_data.py" in ran and "-m retrieval.import_searchr1" in ran and "eval.py --model" in ran, ran


def training_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    sec = text[text.index("## Training\n"):]
    block = re.search(r"```bash\n(.*?)```", sec, re.S).group(1).replace("\\\n", " ")
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_training_section_commands_pass_a_dry_run(tmp_path):
    """The README's launch lines, each with --dry_run appended; the deepspeed launcher gets a localhost
    hostfile of 8 slots and the flags one machine without ssh needs, torchrun runs as written."""
    cmds = training_commands()
    assert len(cmds) == 3 and cmds[0].startswith("deepspeed --hostfile hostfile ")
    (tmp_path / "hostfile").write_text("localhost slots=8\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for cmd in cmds:
        cmd = cmd.replace("deepspeed --hostfile hostfile ", f"deepspeed --hostfile {tmp_path / 'hostfile'} --no_ssh_check "
                          f"--master_addr 127.0.0.1 --master_port {free_port()} ")
        cmd = cmd.replace("torchrun ", f"torchrun --master_port {free_port()} ")
        r = subprocess.run(f"{cmd} --dry_run", shell=True, cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "dry run: ok" in out, (cmd, out[-4000:])
