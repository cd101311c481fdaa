"""eval.py follows the run: the rollout protocol of a checkpoint's run (its config.json) unless a flag says
otherwise, with the source of every setting reported; train.py's flag spellings; --help shows defaults.

The fast tests parse command lines against a run folder laid out like training/engine/checkpoint.py's (config.json
from training.settings.config.Config); the slow one trains a real run with train.py and evaluates its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# what the fake run trained with: every protocol field off eval's defaults
RUN_PROTOCOL = {"dtype": "bfloat16", "template": "r_search", "max_turns": 2, "max_tokens_per_turn": 24,
                "max_total_tokens": 600, "max_info_tokens": 100, "max_model_len": 1024, "topk": 2}


def make_run(root: Path, edit=None, steps=(3, 6), latest: int | None = 6) -> Path:
    """A run folder: config.json as train.py writes it, checkpoints/step_N/hf (an HF config only), latest."""
    from training.settings.config import Config

    cfg = Config()
    cfg.model.dtype, cfg.model.template, cfg.search.topk = "bf16", "r_search", 2
    r = cfg.rollout
    r.max_turns, r.max_tokens_per_turn, r.max_total_tokens, r.max_info_tokens, r.max_model_len = 2, 24, 600, 100, 1024
    r.temperature = 0.7
    (root / "bm25").mkdir(parents=True)
    (root / "bm25/manifest.json").write_text("{}\n")
    cfg.search.index = str(root / "bm25")
    d = cfg.to_dict()
    if edit:
        edit(d)
    run = root / "run"
    for s in steps:
        (run / f"checkpoints/step_{s:06d}/hf").mkdir(parents=True)
        (run / f"checkpoints/step_{s:06d}/hf/config.json").write_text('{"model_type": "llama"}\n')
    if latest:
        (run / "checkpoints/latest").write_text(f"step_{latest:06d}")
    (run / "config.json").write_text(json.dumps(d, indent=2))
    return run


def parse(model, *extra, out=None):
    import eval as eval_cli

    return eval_cli.parse_args(["--model", str(model), "--data", "d.jsonl", "--out_dir", str(out or "/nonexistent/ev"),
                                *map(str, extra)])


def test_protocol_comes_from_the_run_at_every_place_in_its_layout(tmp_path, capsys):
    """The HF export, the checkpoint, checkpoints/ and the run folder all find the run's config.json; the
    last three load the latest checkpoint. Every protocol setting is the run's, the temperature is not."""
    import eval as eval_cli

    run = make_run(tmp_path)
    hf6 = run / "checkpoints/step_000006/hf"
    for model in (hf6, hf6.parent, run / "checkpoints", run):
        a = parse(model)
        assert Path(a.model).resolve() == hf6.resolve(), model
        assert a.run_config == str((run / "config.json").resolve())
        assert {k: getattr(a, k) for k in RUN_PROTOCOL} == RUN_PROTOCOL
        assert all(a.sources[k] == "run config.json" for k in RUN_PROTOCOL)
        assert a.solver_search == "retriever" and a.index == str(tmp_path / "bm25") and a.sources["index"] == "run config.json"
        assert a.temperature == 0.0 and a.sources["temperature"] == "eval default"   # the run sampled at 0.7
        assert a.sources["model"] == ("flag" if model == hf6 else f"flag ({model})")
    a = parse(run / "checkpoints/step_000003/hf")                                   # an older checkpoint
    assert Path(a.model) == run / "checkpoints/step_000003/hf" and a.max_turns == 2
    table = eval_cli.settings_table(a)
    assert table.splitlines()[0] == f"Settings (run config: {a.run_config}):"
    assert any(line.split() == ["max_info_tokens", "100", "run", "config.json"] for line in table.splitlines())
    assert any(line.split() == ["temperature", "0.0", "eval", "default"] for line in table.splitlines())
    assert eval_cli.settings_dict(a)["max_turns"] == {"value": 2, "source": "run config.json"}


def test_a_flag_given_wins_even_at_eval_default(tmp_path):
    """Any spelling of a flag on the command line wins over the run, also when its value equals eval's
    default (--max_info_tokens 512, --topk 3): given-ness is read from the command line, not the value."""
    run = make_run(tmp_path)
    a = parse(run, "--max_turns", "3", "--max_info_tokens", "512", "--topk", "3", "--dtype", "fp32",
              "--temperature", "0.5")
    assert (a.max_turns, a.max_info_tokens, a.topk, a.dtype, a.temperature) == (3, 512, 3, "float32", 0.5)
    for k in ("max_turns", "max_info_tokens", "topk", "dtype", "temperature"):
        assert a.sources[k] == "flag", k
    assert (a.max_tokens_per_turn, a.template, a.sources["template"]) == (24, "r_search", "run config.json")
    a = parse(run, "--max_tok", "30")                          # argparse's abbreviation counts as given too
    assert a.max_tokens_per_turn == 30 and a.sources["max_tokens_per_turn"] == "flag"


def test_no_run_config_and_models_outside_a_run_keep_eval_defaults(tmp_path):
    from eval import build_parser

    run = make_run(tmp_path)
    defaults = {k: build_parser().get_default(k) for k in RUN_PROTOCOL}
    sft = run / "sft/hf"                  # an HF folder below a run folder, not in its checkpoints/: no run
    sft.mkdir(parents=True)
    (sft / "config.json").write_text('{"model_type": "llama"}\n')
    for model, extra in ((run / "checkpoints/step_000006/hf", ["--no_run_config"]), (sft, []), (tmp_path / "m", [])):
        a = parse(model, *extra)
        assert a.run_config is None and {k: getattr(a, k) for k in RUN_PROTOCOL} == defaults
        assert all(a.sources[k] == "eval default" for k in RUN_PROTOCOL)
        assert a.solver_search == "none" and a.index is None and a.sources["solver_search"] == "eval default"
    assert parse(run, "--no_run_config").model == str(run / "checkpoints/step_000006/hf")  # still the latest


def test_run_config_details(tmp_path, capsys):
    """A field an older config.json lacks ran at train.py's default; a run folder without a complete
    checkpoint, and a checkpoint without an HF export, are refused with the reason."""
    def drop(d):
        del d["rollout"]["max_info_tokens"]
    run = make_run(tmp_path / "a", edit=drop)
    a = parse(run)
    assert a.max_info_tokens == 512 and a.sources["max_info_tokens"] == "run config.json"   # RolloutArgs default
    run = make_run(tmp_path / "b", latest=None)
    with pytest.raises(SystemExit):
        parse(run)
    assert "no complete checkpoint" in capsys.readouterr().err
    (run / "checkpoints/step_000009").mkdir()
    with pytest.raises(SystemExit):
        parse(run / "checkpoints/step_000009")
    assert "holds no HF export" in capsys.readouterr().err


def test_search_backend_follows_the_run_unless_a_flag_names_one(tmp_path, capsys):
    def search(**kw):
        return lambda d: d["search"].update(kw)

    def mk(name, **kw):
        return make_run(tmp_path / name, edit=search(**kw))

    a = parse(mk("url", retriever_url="http://127.0.0.1:9"))       # train.py: a URL beats the index
    assert a.retriever_url == "http://127.0.0.1:9" and a.index is None and a.sources["retriever_url"] == "run config.json"
    a = parse(mk("self", solver_search="self"))
    assert a.self_search and not a.simulated and a.solver_search == "self"
    a = parse(mk("sim", solver_search="simulated", sim_url="http://127.0.0.1:7", sim_model="s"))
    assert a.simulated and (a.sim_url, a.sim_model) == ("http://127.0.0.1:7", "s") and a.sources["sim_url"] == "run config.json"
    assert a.sim_noise == 0.0                                        # no training noise curriculum in eval
    run = mk("none", retriever_url="http://127.0.0.1:9")
    a = parse(run, "--solver_search", "none")
    assert a.solver_search == "none" and a.index is None and a.retriever_url is None and a.sources["solver_search"] == "flag"
    a = parse(run, "--self_search")
    assert a.self_search and a.retriever_url is None
    a = parse(run, "--index", tmp_path / "none/bm25")                # a flag's index replaces the run's URL
    assert a.index == str(tmp_path / "none/bm25") and a.retriever_url is None and a.sources["index"] == "flag"
    a = parse(run, "--solver_search", "retriever")                  # the kind named, the run's URL kept
    assert a.retriever_url == "http://127.0.0.1:9" and a.sources["solver_search"] == "flag"
    for extra, msg in ((["--solver_search", "self", "--index", "x"], "got --solver_search self and --index"),
                       (["--solver_search", "none", "--retriever_url", "http://x"], "choose one search backend"),
                       (["--sim_url", "http://x"], "--simulated, which is not set")):
        with pytest.raises(SystemExit):
            parse(run, *extra)
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(mk("gone", index=str(tmp_path / "missing")))
    err = capsys.readouterr().err
    assert "the run's solver searched the index" in err and "--no_run_config" in err
    with pytest.raises(SystemExit):
        parse(tmp_path / "m", "--solver_search", "retriever")
    assert "needs --index or --retriever_url" in capsys.readouterr().err


def test_train_spellings_are_accepted(tmp_path):
    """train.py's flag names beside eval's own: --vllm_tp/--tp, --rollout_engine/--engine, --eval_data a,b /
    --data a b, --eval_limit/--limit, --dtype bf16/fp32/bfloat16/float32, --overwrite [BOOL]."""
    m = tmp_path / "m"
    assert parse(m, "--vllm_tp", 2).tp == parse(m, "--tp", 2).tp == 2
    assert parse(m, "--rollout_engine", "hf").engine == parse(m, "--engine", "hf").engine == "hf"
    assert parse(m, "--eval_limit", 3).limit == parse(m, "--limit", 3).limit == 3
    import eval as eval_cli

    base = ["--model", str(m), "--out_dir", str(tmp_path / "ev")]
    assert eval_cli.parse_args(base + ["--eval_data", "a.jsonl,b.parquet"]).data == ["a.jsonl", "b.parquet"]
    assert eval_cli.parse_args(base + ["--data", "a.jsonl", "b.parquet"]).data == ["a.jsonl", "b.parquet"]
    assert eval_cli.parse_args(base + ["--data", "a.jsonl", "--eval_data", "b.jsonl"]).data == ["a.jsonl", "b.jsonl"]
    with pytest.raises(SystemExit):
        eval_cli.parse_args(base)
    for spelling, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32"), ("float32", "float32")):
        a = parse(m, "--dtype", spelling)
        assert a.dtype == dtype and a.sources["dtype"] == "flag"
    out = tmp_path / "ev"
    out.mkdir()
    (out / "results.json").write_text("{}\n")
    for extra, want in (([], False), (["--overwrite"], True), (["--overwrite", "true"], True),
                        (["--overwrite", "false"], False), (["--overwrite", "yes", "--topk", "2"], True)):
        if want:
            assert parse(m, *extra, out=out).overwrite is True
        else:
            with pytest.raises(SystemExit):
                parse(m, *extra, out=out)


def test_help_shows_defaults(capsys):
    import eval as eval_cli

    with pytest.raises(SystemExit) as e:
        eval_cli.parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())    # argparse wraps lines
    for flag, default in (("--max_turns MAX_TURNS", "4"), ("--max_info_tokens MAX_INFO_TOKENS", "512"),
                          ("--dtype", "float32"), ("--vllm_tp N, --tp N", "1"), ("--temperature TEMPERATURE", "0.0"),
                          ("--rollout_engine {vllm,hf}, --engine {vllm,hf}", "vllm"), ("--overwrite [BOOL]", "False")):
        at = text.index(flag, text.index("options:"))       # past the usage line
        assert f"(default: {default})" in text[at: at + 400], flag
    assert "--no_run_config" in text and "--eval_data EVAL_DATA" in text and "--solver_search" in text


def test_docs_show_the_checkpoint_layout():
    """training/engine/checkpoint.py writes <run>/checkpoints/step_N/hf; no doc may show the old runs/x/hf/step_N."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Evaluation"):]
    section = section[: section.index("\n## ", 3)]
    for text in ((REPO / "eval.py").read_text(), (REPO / "scripts/eval.sh").read_text(), section):
        assert "hf/step_" not in text
    assert "checkpoints/step_000100/hf" in (REPO / "eval.py").read_text()
    assert "checkpoints/step_000004/hf" not in section    # the demo keeps only its 2 last checkpoints


def _fake_py(tmp_path: Path) -> Path:
    """A PY for scripts/eval.sh that records eval.py's arguments instead of running it."""
    py = tmp_path / "py"
    py.write_text(f'#!/usr/bin/env bash\nif [ "$1" = eval.py ]; then shift; printf "%s\\n" "$@" > {tmp_path}/argv; '
                  f'exit 0; fi\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py


def test_eval_sh_leaves_the_protocol_to_the_run(tmp_path):
    """eval.sh passes TOPK / MAX_TURNS / INDEX only when set, so a MODEL in a run keeps the run's protocol
    (and its out_dir is named after the run and step); outside a run it searches the BM25 index."""
    run = make_run(tmp_path)
    env = dict(os.environ, PY=str(_fake_py(tmp_path)), DATA="data/eval/capitals.jsonl")

    def sh(**kw) -> list[str]:
        subprocess.run(["bash", "scripts/eval.sh"], cwd=REPO, env={**env, **kw}, check=True, capture_output=True)
        return (tmp_path / "argv").read_text().splitlines()

    argv = sh(MODEL=str(run / "checkpoints/step_000006/hf"), OUT_DIR=str(tmp_path / "ev"))
    assert not {"--topk", "--max_turns", "--index", "--retriever_url"} & set(argv)
    argv = sh(MODEL=str(run), TOPK="5", INDEX=str(tmp_path / "bm25"), OUT_DIR=str(tmp_path / "ev"))
    assert argv[argv.index("--topk") + 1] == "5" and argv[argv.index("--index") + 1] == str(tmp_path / "bm25")
    m = tmp_path / "model"
    m.mkdir()
    argv = sh(MODEL=str(m), INDEX=str(tmp_path / "bm25"), OUT_DIR=str(tmp_path / "ev"))
    assert argv[argv.index("--index") + 1] == str(tmp_path / "bm25")
    out_dir = subprocess.run(["bash", "-c", 'source <(sed -n "/^OUT_DIR=/p" scripts/eval.sh); echo "$OUT_DIR"'],
                             cwd=REPO, env={**env, "IN_RUN": "run_step_000006", "MODEL": "x"}, capture_output=True,
                             text=True).stdout.strip()
    assert out_dir == "runs/eval/run_step_000006"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_of_a_real_run_checkpoint_follows_the_run(tiny_model_dir, tmp_path):
    """train.py (one process, HF rollout engine, tiny model) writes a run with a non-default protocol and an
    HF export per checkpoint; eval.py on checkpoints/step_N/hf with no protocol flags evaluates under exactly
    the run's protocol (results.json "settings", config.json, the turn counts), and a flag overrides one value."""
    import eval as eval_cli
    from retrieval.build_index import build_index

    corpus = [json.loads(line) for line in (REPO / "data/corpus/wiki.jsonl").open()][:100]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus))
    build_index(tmp_path / "corpus.jsonl", tmp_path / "bm25", "bm25")
    titles = [c["contents"].split("\n")[0] for c in corpus]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"question": f"Which article is titled {t}?", "golden_answers": [t],
                                                           "data_source": "synthetic"}) + "\n" for t in titles[:8]))
    run = tmp_path / "run"
    protocol = ["--template", "r_search", "--max_turns", "2", "--max_tokens_per_turn", "24", "--max_info_tokens", "100",
                "--max_total_tokens", "600", "--max_model_len", "1024", "--topk", "2"]
    cmd = [sys.executable, "train.py", "--model_path", str(tiny_model_dir), "--dtype", "fp32", "--gradient_checkpointing",
           "false", "--rollout_engine", "hf", "--self_play_enable", "false", "--proposer_enable", "false",
           "--qa_data", str(tmp_path / "qa.jsonl"), "--index", str(tmp_path / "bm25"), "--prompts_per_step", "2",
           "--solver_n", "2", "--total_steps", "2", *protocol, "--micro_token_budget", "1024", "--save_every", "1",
           "--max_ckpts", "1", "--export_hf", "true", "--tensorboard", "false", "--sample_every", "0",
           "--output_dir", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    hf = run / "checkpoints/step_000002/hf"
    assert (hf / "config.json").exists() and not (run / "checkpoints/step_000001").exists()   # max_ckpts 1
    trained = json.loads((run / "config.json").read_text())
    want = {"dtype": "float32", "template": trained["model"]["template"], "topk": trained["search"]["topk"],
            "index": trained["search"]["index"], "solver_search": trained["search"]["solver_search"],
            **{k: trained["rollout"][k] for k in ("max_turns", "max_tokens_per_turn", "max_total_tokens",
                                                   "max_info_tokens", "max_model_len")}}
    assert want == {"dtype": "float32", "template": "r_search", "topk": 2, "index": str(tmp_path / "bm25"),
                    "solver_search": "retriever", "max_turns": 2, "max_tokens_per_turn": 24, "max_total_tokens": 600,
                    "max_info_tokens": 100, "max_model_len": 1024}

    base = ["--model", str(hf), "--engine", "hf", "--data", "data/eval/capitals.jsonl", "--limit", "3"]
    assert eval_cli.main(base + ["--out_dir", str(tmp_path / "ev")]) == 0
    res = json.loads((tmp_path / "ev/results.json").read_text())
    got = {k: s["value"] for k, s in res["settings"].items() if k in want}
    assert got == want and all(res["settings"][k]["source"] == "run config.json" for k in want)
    assert res["settings"]["temperature"] == {"value": 0.0, "source": "eval default"}
    assert res["protocol"]["run_config"] == str(run / "config.json")
    assert res["protocol"]["token_caps"] == "24/turn, 100/information block, 600 total"
    assert res["protocol"]["retriever"] == f"bm25 index at {tmp_path / 'bm25'} (100 docs)"
    assert res["protocol"]["template"] == "r_search" and res["protocol"]["max_turns"] == 2
    cfg = json.loads((tmp_path / "ev/config.json").read_text())
    assert {k: cfg[k] for k in want} == want and cfg["run_config"] == str(run / "config.json")
    examples = [json.loads(line) for line in (tmp_path / "ev/examples.jsonl").read_text().splitlines()]
    assert len(examples) == 3 and all(1 <= e["turns"] <= 2 for e in examples)
    assert "| max_info_tokens | 100 | run config.json |" in (tmp_path / "ev/results.md").read_text()

    # an explicit flag overrides one value, the rest still comes from the run; the run folder means its latest
    assert eval_cli.main(base[:1] + [str(run)] + base[2:] + ["--max_turns", "1", "--out_dir", str(tmp_path / "ev1")]) == 0
    res1 = json.loads((tmp_path / "ev1/results.json").read_text())
    assert res1["settings"]["max_turns"] == {"value": 1, "source": "flag"}
    assert {k: s["value"] for k, s in res1["settings"].items() if k in want} == {**want, "max_turns": 1}
    assert res1["settings"]["model"]["value"] == str(hf)
    assert all(json.loads(line)["turns"] == 1 for line in (tmp_path / "ev1/examples.jsonl").read_text().splitlines())
