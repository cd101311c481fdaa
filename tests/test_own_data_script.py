"""A user's own files, start to finish (issue 42): scripts/own_data_cpu.sh on CPU and a per-size GPU script take
the same small files, written here in docs/data.md's formats (proposer rows, a corpus, QA rows, an eval set).

DRY_RUN=1 reads every file and prints the commands it would run, so the tests parse those commands with the
entry points' own parsers: the user's files reach train.py and eval.py, with the recipe that plays
(scripts/recipe.sh), and a bad file is refused before anything runs, with a message naming it. The GPU script's
flags are caught by a stand-in `deepspeed` and then dry-run through train.py at 8 ranks. One slow test runs the
CPU script for real at a smoke scale (a tiny random model as the SFT export, one step).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from training.settings.config import Config, config_from_flags

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "own_data_cpu.sh"
GPU_SCRIPT = REPO / "scripts" / "train_qwen2.5_3b_instruct.sh"
RECIPE = REPO / "scripts" / "recipe.sh"
PROOF = REPO / "scripts" / "learning_proof_cpu.sh"
# the recipe that plays: the learning proof's game (bench/RESULTS.md, learning_game_settings)
GAME = {"rag_verify": "policy", "proposer_reward": "1-acc", "format_penalty": -1.0, "pool_min_solve_rate": 0.01,
        "pool_max_solve_rate": 0.99}
GAME_CPU = {"min_searches": 1, "min_question_words": 4, "rag_distractors": 0}

DOCS = [("Danube", "The Danube flows through Vienna, Bratislava and Budapest to the Black Sea."),
        ("Algiers", "Algiers is the capital and largest city of Algeria."),
        ("Chinua Achebe", "Chinua Achebe was a Nigerian novelist, the author of Things Fall Apart."),
        ("Iron", "Iron is a chemical element with the symbol Fe and atomic number 26.")]


def write_files(d: Path) -> dict[str, Path]:
    """One small file of each kind, in docs/data.md's formats."""
    d.mkdir(parents=True, exist_ok=True)
    files = {k: d / f"{k}.jsonl" for k in ("answers", "corpus", "qa", "eval")}
    rows = {
        "answers": [{"answer": "Danube", "search_turns": 1}, {"answer": ["Algiers", "Alger"], "search_turns": 2},
                    {"answer": "Chinua Achebe", "search_turns": 2, "data_source": "name", "title": "Chinua Achebe"}],
        "corpus": [{"id": str(i), "contents": f"{t}\n{x}"} for i, (t, x) in enumerate(DOCS)],
        "qa": [{"question": "Which river flows through Vienna?", "golden_answers": ["Danube"], "data_source": "rivers"},
               {"question": "What is the capital of Algeria?", "golden_answers": ["Algiers"], "data_source": "capitals"}],
        "eval": [{"id": "e0", "question": "What is the atomic number of iron?", "golden_answers": ["26"],
                  "data_source": "science"},
                 {"id": "e1", "question": "Who wrote Things Fall Apart?", "golden_answers": ["Chinua Achebe"],
                  "data_source": "books"}],
    }
    for k, f in files.items():
        f.write_text("".join(json.dumps(r) + "\n" for r in rows[k]))
    return files


def user_env(files: dict[str, Path], out: Path, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "TRAIN_DATA", "CORPUS", "INDEX", "QA_DATA", "EVAL_DATA", "DRY_RUN", "DTYPE", "SFT_DIR", "OUT", "RETRIEVER_URL",
        "JUDGE_URL", "MODEL", "LAUNCHER_ARGS", "RAG_VERIFY")}
    env.update(TRAIN_DATA=str(files["answers"]), CORPUS=str(files["corpus"]), QA_DATA=str(files["qa"]),
               EVAL_DATA=str(files["eval"]), OUT=str(out), PY=sys.executable, HF_HUB_OFFLINE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.update(kw)
    return env


def dry_run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env={**env, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=120)


def printed(out: str) -> list[list[str]]:
    """The commands a dry run printed ('+ cmd args...', shell-quoted), as argv lists without a leading `env A=B`."""
    cmds = []
    for line in out.splitlines():
        if line.startswith("+ "):
            argv = shlex.split(line[2:])
            if argv[0] == "env":
                argv = argv[1:]
                while argv and re.match(r"^[A-Z_]+=", argv[0]):
                    argv.pop(0)
            cmds.append(argv)
    return cmds


def train_config(argv: list[str]) -> Config:
    """train.py's flags (the words after train.py) through train.py's own parser (--dry_run is train.py's own)."""
    flags = [w for w in argv[argv.index("train.py") + 1:] if w != "--dry_run"]
    return config_from_flags(flags)


def eval_args(argv: list[str]):
    spec = importlib.util.spec_from_file_location("eval_entry", REPO / "eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_parser().parse_args(argv[argv.index("eval.py") + 1:])


def test_dry_run_names_the_users_files_and_the_recipe(tmp_path):
    files = write_files(tmp_path / "mine")
    out, sft = tmp_path / "run", tmp_path / "sft"
    r = dry_run(user_env(files, out, SFT_DIR=str(sft), DTYPE="fp32", STEPS="3"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("own_data_cpu.sh: dry run: ok")
    for kind, n in (("answers", "3 answers"), ("qa", "2 questions"), ("eval", "2 questions")):
        assert f"{files[kind]}: {n}" in r.stdout, r.stdout
    assert f"--corpus {files['corpus']}: every document read, 4 with a title line" in r.stdout
    assert "answers in the corpus: 3 of the first 3" in r.stdout
    cmds = printed(r.stdout)
    by = {next((w for w in c if w.endswith((".sh", ".py")) and w != "-m"), c[0]): c for c in cmds}
    # the SFT export is missing, so the demo's cold start would make it; the corpus is indexed into OUT
    assert by["scripts/sft_coldstart.sh"][-1] == str(sft)
    index = out / "index" / "bm25"
    assert f"CORPUS={files['corpus']} OUT={out / 'index'} KINDS=bm25 bash scripts/build_index.sh" in r.stdout
    # train.py: the user's files, the SFT export, and the recipe that plays
    train = next(c for c in cmds if "train.py" in c)
    assert train[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cfg = train_config(train)
    assert cfg.selfplay.train_data == str(files["answers"]) and cfg.selfplay.pool_init == str(files["qa"])
    assert cfg.search.index == str(index) and not cfg.search.retriever_url
    assert cfg.model.model_path == str(sft / "hf") and cfg.model.dtype == "fp32"
    assert cfg.optimisation.total_steps == 3 and cfg.logging.output_dir == str(out)
    for k, v in {**GAME, **GAME_CPU}.items():
        assert getattr(cfg.selfplay, k) == v, (k, getattr(cfg.selfplay, k))
    ro = cfg.rollout
    assert (ro.max_turns, ro.max_tokens_per_turn, ro.max_total_tokens, ro.max_info_tokens) == (3, 64, 1024, 160)
    # eval.py, on the SFT start and on the last checkpoint: the user's eval set, the same index and protocol
    evals = [eval_args(c) for c in cmds if "eval.py" in c]
    assert [e.model for e in evals] == [str(sft / "hf"), str(out / "checkpoints" / "step_000003" / "hf")]
    for e in evals:
        assert e.data == [str(files["eval"])] and e.index == str(index) and e.dtype == "float32"
        assert (e.max_turns, e.max_tokens_per_turn, e.max_info_tokens) == (3, 64, 160)
    assert not out.exists() and not sft.exists(), "a dry run writes nothing"


def test_dry_run_reuses_a_built_sft_export_and_index(tmp_path, tiny_model_dir):
    """An SFT export already there is reused (and checked as a model folder); an index given by INDEX is searched
    as it is, no corpus needed; a comma list of eval files reaches eval.py whole; no QA rows, no --pool_init."""
    files = write_files(tmp_path / "mine")
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "hf").symlink_to(tiny_model_dir, target_is_directory=True)
    index = tmp_path / "idx" / "bm25"
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(files["corpus"]), "--out", str(index),
                    "--kind", "bm25"], cwd=REPO, check=True, capture_output=True)
    env = user_env(files, tmp_path / "run", SFT_DIR=str(sft), INDEX=str(index), CORPUS="", QA_DATA="",
                   EVAL_DATA=f"{files['eval']},{files['qa']}", DTYPE="fp32")
    r = dry_run(env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reused: " + str(sft / "hf") in r.stdout and f"reused: {index} is built" in r.stdout
    cmds = printed(r.stdout)
    assert not any("sft_coldstart.sh" in c or "build_index.sh" in " ".join(c) for c in cmds)
    cfg = train_config(next(c for c in cmds if "train.py" in c))
    assert cfg.search.index == str(index) and cfg.selfplay.pool_init == ""
    assert all(eval_args(c).data == [str(files["eval"]), str(files["qa"])] for c in cmds if "eval.py" in c)


BAD = {  # file kind: (the row that lacks a required field, what the message must name)
    "answers": ({"answer": "Danube"}, "search_turns"),
    "qa": ({"question": "Which river flows through Vienna?"}, "golden_answers"),
    "eval": ({"golden_answers": ["26"]}, "question"),
    "corpus": ({"id": "9", "title": "Iron"}, "'contents'"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_file_is_refused_naming_it(tmp_path, kind):
    files = write_files(tmp_path / "mine")
    row, field = BAD[kind]
    with files[kind].open("a") as f:
        f.write(json.dumps(row) + "\n")
    r = dry_run(user_env(files, tmp_path / "run", SFT_DIR=str(tmp_path / "sft"), DTYPE="fp32"))
    assert r.returncode == 2, r.stdout + r.stderr
    bad_line = len(files[kind].read_text().splitlines())
    assert str(files[kind]) in r.stderr and field in r.stderr, r.stderr
    assert re.search(rf"{re.escape(str(files[kind]))}: ?(line )?{bad_line}\b", r.stderr), r.stderr
    assert "docs/data.md" in r.stderr and "+ " not in r.stdout, "nothing is printed to run after a refusal"


def test_missing_inputs_are_named(tmp_path):
    files = write_files(tmp_path / "mine")
    base = user_env(files, tmp_path / "run", SFT_DIR=str(tmp_path / "sft"), DTYPE="fp32")
    r = dry_run({**base, "TRAIN_DATA": ""})
    assert r.returncode == 2 and "set TRAIN_DATA to your proposer answer rows" in r.stderr
    r = dry_run({**base, "CORPUS": ""})
    assert r.returncode == 2 and "set CORPUS to your documents" in r.stderr
    r = dry_run({**base, "EVAL_DATA": f"{files['eval']} {tmp_path / 'nope.jsonl'}"})
    assert r.returncode == 2 and f"EVAL_DATA: {tmp_path / 'nope.jsonl'}: no such file" in r.stderr
    # an index in OUT built from another corpus is not searched as if it were this one
    other = tmp_path / "other.jsonl"
    other.write_text(files["corpus"].read_text())
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(other), "--out",
                    str(tmp_path / "run" / "index" / "bm25"), "--kind", "bm25"], cwd=REPO, check=True, capture_output=True)
    r = dry_run(base)
    assert r.returncode == 2 and f"was built from {other}, not from --corpus {files['corpus']}" in r.stderr, r.stderr


def _defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=\$\{\1:-\"?([^}\"]*)\"?\}", text, re.M))


def test_the_recipe_is_the_learning_proofs_game():
    """scripts/recipe.sh spells out the game of the learning proof (which keeps its own copy: its file stamps the
    measured results), setting by setting, at the same defaults."""
    recipe, proof = _defaults(RECIPE.read_text()), _defaults(PROOF.read_text())
    for var in ("RAG_VERIFY", "PROPOSER_REWARD", "FORMAT_PENALTY", "POOL_SOLVE", "MIN_SEARCHES", "RAG_DISTRACTORS",
                "MAX_TOKENS_PER_TURN"):
        assert recipe[var] == proof[var], (var, recipe[var], proof[var])
    assert "--min_question_words 4" in PROOF.read_text() and recipe["MIN_QUESTION_WORDS"] == "4"
    # and what those defaults are: the game of bench/RESULTS.md's ladder recipe
    assert (recipe["RAG_VERIFY"], recipe["PROPOSER_REWARD"], recipe["FORMAT_PENALTY"]) == ("policy", "1-acc", "-1")
    assert recipe["POOL_SOLVE"] == "0.01 0.99" and (recipe["MIN_SEARCHES"], recipe["RAG_DISTRACTORS"]) == ("1", "0")


def test_the_recipes_game_is_train_pys_default(tmp_path):
    """Issue 42, point 2: the game shown to play on CPU is what train.py plays when no flag is given, library and
    flags alike (GameConfig's defaults are the flags'). Only the CPU scale's settings stay in the scripts: a 135M
    model's shorter questions, fewer searches and no distractors (scripts/recipe.sh, GAME_CPU)."""
    from inference.game import GameConfig
    from training.settings.config import parse_config
    recipe = _defaults(RECIPE.read_text())
    pool_min, pool_max = (float(x) for x in recipe["POOL_SOLVE"].split())
    lib = GameConfig()
    assert (lib.rag_verify, lib.proposer_reward, lib.format_penalty) == (
        recipe["RAG_VERIFY"], recipe["PROPOSER_REWARD"], float(recipe["FORMAT_PENALTY"]))   # auto resolves to 1-acc
    assert (lib.pool_min_solve_rate, lib.pool_max_solve_rate) == (pool_min, pool_max)
    (tmp_path / "model").mkdir()
    (tmp_path / "idx").mkdir()
    (tmp_path / "rows.jsonl").write_text('{"answer": "Paris", "search_turns": 2}\n')
    sp = parse_config(["--model_path", str(tmp_path / "model"), "--train_data", str(tmp_path / "rows.jsonl"),
                       "--index", str(tmp_path / "idx")]).selfplay
    assert (sp.rag_verify, sp.format_penalty, sp.pool_min_solve_rate, sp.pool_max_solve_rate) == (
        recipe["RAG_VERIFY"], float(recipe["FORMAT_PENALTY"]), pool_min, pool_max)
    assert sp.proposer_reward == recipe["PROPOSER_REWARD"]   # "auto" resolved at parse time: 1-acc with a RAG check
    # the CPU scale's settings are not train.py's: SSP's own floors stay the defaults
    assert (lib.min_searches, lib.rag_distractors) != (int(recipe["MIN_SEARCHES"]), int(recipe["RAG_DISTRACTORS"]))


# ----------------------------------------------------------------------------- the same files on a GPU script

def gpu_flags(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, list[str]]:
    """(the run, the train.py flags) of the 3B script under DRY_RUN=1, a stand-in `deepspeed` printing its argv."""
    (tmp / "bin").mkdir(parents=True, exist_ok=True)
    fake = tmp / "bin" / "deepspeed"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@"\n')
    fake.chmod(0o755)
    (tmp / "hostfile").write_text("localhost slots=8\n")
    env = {**env, "DRY_RUN": "1", "PATH": f"{tmp / 'bin'}{os.pathsep}{env['PATH']}"}
    env.pop("PY", None)   # the GPU script runs the python on PATH, as in an activated .venv-gpu
    r = subprocess.run(["bash", str(GPU_SCRIPT), str(tmp / "hostfile")], capture_output=True, text=True, env=env,
                       cwd=tmp, timeout=120)
    argv = r.stdout.split("\0")[:-1]
    return r, (argv[argv.index("train.py") + 1:] if "train.py" in argv else [])


def test_a_gpu_script_takes_the_same_files_with_the_recipe(tmp_path):
    files = write_files(tmp_path / "mine")
    out = tmp_path / "gpu_run"
    env = user_env(files, out)
    r, argv = gpu_flags(tmp_path, env)
    assert r.returncode == 0 and argv, r.stdout + r.stderr
    assert "3 answers" in r.stdout and f"--corpus {files['corpus']}" in r.stdout   # the files were read first
    index = out / "index" / "bm25"
    assert f"would build the index first: env CORPUS={files['corpus']} OUT={out / 'index'} KINDS=bm25" in r.stdout
    cfg = train_config(["train.py", *argv])
    assert cfg.selfplay.train_data == str(files["answers"]) and cfg.selfplay.pool_init == str(files["qa"])
    assert cfg.eval.eval_data == str(files["eval"]) and cfg.search.index == str(index) and not cfg.search.retriever_url
    assert "--allow_demo_defaults" not in argv and argv[-1] == "--dry_run"
    for k, v in GAME.items():
        assert getattr(cfg.selfplay, k) == v, (k, getattr(cfg.selfplay, k))
    # the CPU-only settings stay train.py's (SSP's 2 searches, 10 words)
    assert cfg.selfplay.min_searches == 2 and cfg.selfplay.min_question_words == 10
    assert not out.exists(), "a dry run builds no index and writes no output dir"
    # a judge takes the verifier's place; a retriever server takes the index's; a bad file stops the launch
    _, judged = gpu_flags(tmp_path, {**env, "JUDGE_URL": "http://127.0.0.1:9/v1", "RETRIEVER_URL": "http://127.0.0.1:8000"})
    jc = train_config(["train.py", *judged])
    assert jc.selfplay.rag_verify == "judge" and jc.selfplay.judge == "llm" and jc.selfplay.proposer_reward == "1-acc"
    assert jc.search.retriever_url == "http://127.0.0.1:8000" and "--index" not in judged
    # a file not on this machine: listed by the dry run (a login node), as train.py --dry_run lists it
    r, argv = gpu_flags(tmp_path, {**env, "TRAIN_DATA": "/data/not/here.parquet"})
    assert r.returncode == 0 and "--train_data /data/not/here.parquet: not on this machine, not checked" in r.stdout
    with files["qa"].open("a") as f:
        f.write('{"question": "Where?"}\n')
    r, argv = gpu_flags(tmp_path, env)
    assert r.returncode == 2 and not argv and str(files["qa"]) in r.stderr and "golden_answers" in r.stderr


@pytest.mark.timeout(300)
def test_the_gpu_scripts_flags_pass_train_py_dry_run_at_8_ranks(tmp_path):
    """The 3B script's flags with the user's files and an index built from their corpus: train.py's own dry run,
    as local rank 0 of 8 (the files read by the trainer's preflight, the configs checked), passes."""
    files = write_files(tmp_path / "mine")
    out = tmp_path / "gpu_run"
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(files["corpus"]), "--out",
                    str(out / "index" / "bm25"), "--kind", "bm25"], cwd=REPO, check=True, capture_output=True)
    _, argv = gpu_flags(tmp_path, user_env(files, out))
    env = {k: v for k, v in os.environ.items()}
    env.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8", HF_HUB_OFFLINE="1",
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=280, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("dry run: ok") and "demo defaults" not in r.stdout
    cfg = json.loads(r.stdout.split("train.py --dry_run: resolved config\n", 1)[1].split("DeepSpeed config (actor)\n")[0])
    assert cfg["selfplay"]["rag_verify"] == "policy" and cfg["search"]["index"] == str(out / "index" / "bm25")


# ----------------------------------------------------------------------------- for real, at a smoke scale

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_data_trains_and_evaluates(tmp_path, tiny_model_dir):
    """The script as a user runs it, on the small files: the corpus indexed, one self-play step on 2 ranks from the
    'SFT export' (the tiny random model: the path, not the learning), eval.py on the start and the step-1 model."""
    files = write_files(tmp_path / "mine")
    sft, out = tmp_path / "sft", tmp_path / "run"
    sft.mkdir()
    (sft / "hf").symlink_to(tiny_model_dir, target_is_directory=True)
    env = user_env(files, out, SFT_DIR=str(sft), DTYPE="fp32", STEPS="1", PROMPTS="2", MAX_TOKENS_PER_TURN="16",
                   NPROC="2", EVAL_LIMIT="2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    r = subprocess.run(["bash", str(SCRIPT), "--train_top_layers", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=880)   # the tiny model has 2 layers, not 8
    assert r.returncode == 0, r.stdout[-6000:]
    assert (out / "index" / "bm25" / "manifest.json").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["selfplay"]["train_data"] == str(files["answers"]) and cfg["selfplay"]["rag_verify"] == "policy"
    for d in ("eval_sft", "eval"):
        res = json.loads((out / d / "results.json").read_text())
        assert res["overall"]["n"] == 2 and set(res["per_source"]) == {"science", "books"}, res
    assert "valid questions" in r.stdout   # the games table
