"""scripts/learning_proof_cpu.sh runs end to end: the RL core (rung 1) and SSP (rung 2) at a smoke scale, then the
report over what they wrote; the other rungs' wiring with train.py and eval.py stubbed (below).

The SFT start is the session's smoke SFT (tests/conftest.py, smoke_sft: scripts/sft_coldstart.sh on 8 demos in one
step from a tiny random Llama: the script's path, not what a model learns; shared with the demo's test), handed
to the ladder as SFT_DIR; one RL step per rung, 2 held-out rows per file, results written to a temporary
BENCH_RESULTS_DIR (never over bench/RESULTS.md). About 2.5 minutes on 2 cores; needs the .venv of
scripts/setup_cpu.sh, which the script calls first and which returns at once when installed.

Rungs 0 (pass@k headroom), 1gae (a critic) and 3 (self-distillation) add flags to the same launches, not paths of
their own: the stubbed test below holds what the script passes them (parsed by train.py's own parser), and what
those flags do is tested where they are read: pass@K in tests/test_eval.py, the critic's step and checkpoint in
tests/training/test_trainer.py (test_gae_with_a_critic_trains_and_resumes_exactly), the teacher in
tests/training/test_modes.py, and their report sections in tests/test_learning_proof_summary.py. Running them here
too cost 9 more launches (about 3.5 minutes, issue 43)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROOF = REPO / "scripts" / "learning_proof_cpu.sh"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # .ci/run's --timeout 900 is per test; this one runs the real script twice
def test_ladder_smoke_runs_rungs_1_and_2_and_reports(tmp_path, smoke_sft):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the .venv of scripts/setup_cpu.sh")
    out, bench = tmp_path / "lp", tmp_path / "bench"
    bench.mkdir()
    env = {**os.environ, "OUT": str(out), "BENCH_RESULTS_DIR": str(bench), "SEEDS": "1", "QA_STEPS": "1", "STEPS": "1",
           "RUNGS": "1 2",
           "SFT_DIR": str(smoke_sft), "QA_PROMPTS": "2", "PROMPTS": "2", "SOLVER_N": "2", "DEV_ROWS": "4", "EVAL_LIMIT": "2", "MAX_TOKENS_PER_TURN": "16",
           "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions")}
    r = subprocess.run(["bash", str(PROOF)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1500)
    (tmp_path / "proof.log").write_text(r.stdout)
    assert r.returncode == 0, r.stdout[-6000:]
    # the SFT_DIR given holds a finished export: the ladder starts from it (sft_coldstart.sh says so) and times no SFT
    assert "SFT cold start: skipped" in r.stdout

    # the demo mix the SFT trained on fits the ladder's own rollout protocol, demo by demo (issue 31)
    from transformers import AutoTokenizer

    from tests.recipe_protocol import misfits, script_protocol
    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "SmolLM2-135M-Instruct")
    assert not misfits(REPO / "data" / "train" / "coldstart_mix.jsonl", script_protocol(PROOF), tok)

    # the dev split is cut from the QA rows and kept apart from what rung 1 trains on
    dev = [json.loads(x) for x in (out / "qa_dev.jsonl").read_text().splitlines()]
    train = {json.loads(x)["question"] for x in (out / "qa_train.jsonl").read_text().splitlines()}
    assert len(dev) == 4 and not ({d["question"] for d in dev} & train)
    assert all(d["data_source"] in ("reading_dev", "twohop_dev", "wiki_desc_dev") for d in dev)

    # each rung trained from the one SFT start, with its own game
    qa_cfg = json.loads((out / "qa_seed1" / "config.json").read_text())
    ssp_cfg = json.loads((out / "seed1" / "config.json").read_text())
    assert qa_cfg["model"]["model_path"] == ssp_cfg["model"]["model_path"] == str(smoke_sft / "hf")
    assert qa_cfg["selfplay"]["self_play_enable"] is False and ssp_cfg["selfplay"]["self_play_enable"] is True
    # one rollout protocol for RL and eval: the smoke scale's MAX_TOKENS_PER_TURN reached both
    assert qa_cfg["rollout"]["max_tokens_per_turn"] == ssp_cfg["rollout"]["max_tokens_per_turn"] == 16
    assert json.loads((out / "eval_sft" / "results.json").read_text())["settings"]["max_tokens_per_turn"]["value"] == 16
    # rung 2 is also scored on the dev split at its last milestone (where settings are chosen); rung 1 is not
    assert (out / "seed1" / "dev_step1" / "results.json").exists() and not (out / "qa_seed1" / "dev_step1").exists()
    # the game's signal is logged in every step, and every trajectory is there to read (--dump_rollouts)
    ssp_steps = [json.loads(x) for x in (out / "seed1" / "metrics.jsonl").read_text().splitlines()]
    game = [m for m in ssp_steps if "game/valid_rate" in m]
    assert game and all(k in game[0] for k in ("game/solver_groups", "game/informative_groups", "game/fresh_s0",
                                               "game/no_question", "game/no_question/turn_cap", "game/pool_repeats"))
    dumped = [json.loads(x) for f in sorted((out / "seed1" / "rollouts").glob("step_1.rank*.jsonl"))
              for x in f.read_text().splitlines()]
    assert sum(d["role"] == "proposer" for d in dumped) == game[0]["game/proposer_trajs"] > 0
    # solver rollouts only for the valid questions and pool fills of the step (at smoke scale often none)
    assert sum(d["role"] == "solver" for d in dumped) == game[0].get("rollout/solver_trajs", 0)
    qa_steps = [json.loads(x) for x in (out / "qa_seed1" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("train/solver_tokens", 0) > 0 and m.get("train/proposer_tokens", 1) == 0 for m in qa_steps)

    # every rung reported, into the temporary results, not bench/
    keys = json.loads((bench / "results.json").read_text())
    for k in ("learning_qa.solver_acc_gain", "learning_qa.seed_std", "learning.solver_acc_gain",
              "learning_qa.reading_gain", "learning_qa.reading_seed_std", "learning.reading_gain",
              "learning_qa.searches_per_question", "learning_baseline.title_em"):
        assert k in keys, k
    assert not any(k.startswith(("learning_distill", "learning_qa_gae")) or "passk" in k for k in keys), keys
    md = (bench / "RESULTS.md").read_text()
    assert all(f"## {s}" in md for s in ("learning_qa", "learning", "learning_baseline"))
    assert "## learning_headroom" not in md and "## learning_distill" not in md
    # the held-out protocol holds the reading and two-hop sets, measured against the title heuristic
    sft = json.loads((out / "eval_sft" / "results.json").read_text())
    assert {"reading_heldout", "twohop_heldout"} <= set(sft["per_source"])
    assert "title_baseline_em" in sft["overall"] and "searches_hist" in sft["per_source"]["twohop_heldout"]
    assert (bench / "learning_proof.png").stat().st_size > 10_000
    stages = {line.split("\t")[0] for line in (out / "timings.tsv").read_text().splitlines()}
    assert stages == {"eval_sft", "rl_qa", "eval_qa_step1", "rl", "eval_step1"}, stages   # no SFT timed, no rung 0

    # a second call finds everything done and only re-reports
    again = subprocess.run(["bash", str(PROOF)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "SFT cold start: skipped" in again.stdout and "RL up to step" not in again.stdout


_STUB_PY = r'''#!/usr/bin/env bash
# a stand-in for .venv/bin/python: train.py and eval.py write what the script checks for; the rest is real Python
case "$1" in
  -|-m) [ "$1 $2" = "-m utils.cpu_dtype" ] && { echo fp32; exit 0; }; exec "$REAL_PY" "$@" ;;
  scripts/prepare_data.py|bench/learning_proof.py) echo "STUB $*" ;;
  train.py) a=("$@"); for ((i=0; i<${#a[@]}; i++)); do case "${a[i]}" in --output_dir) out=${a[i+1]};;
      --total_steps) n=${a[i+1]};; esac; done
    d=$out/checkpoints/step_$(printf %06d "$n")/hf; mkdir -p "$d"; echo '{}' > "$d/config.json"; touch "$d/model.safetensors"
    echo "TRAIN $out $n" ;;
  eval.py) a=("$@"); for ((i=0; i<${#a[@]}; i++)); do [ "${a[i]}" = --out_dir ] && out=${a[i+1]}; done
    mkdir -p "$out"; echo '{}' > "$out/results.json"; echo "EVAL $out" ;;
esac
'''


def _stub_repo(tmp_path):
    """The script in a throw-away git repository whose python, SFT and setup are stubs: its own control flow only."""
    import shutil
    import sys
    root = tmp_path / "repo"
    for d in ("scripts", "bench", ".venv/bin", "data/indexes/bm25", "data/train"):
        (root / d).mkdir(parents=True)
    shutil.copy(PROOF, root / "scripts")
    for f in ("learning_compare.py", "learning_common.py", "learning_stats.py", "report.py", "learning_protocol.json"):
        shutil.copy(REPO / "bench" / f, root / "bench")
    (root / "data/indexes/bm25/manifest.json").write_text("{}")
    (root / "data/train/solver_mix.jsonl").write_text("".join(f'{{"question": "q{i}", "data_source": "reading"}}\n'
                                                             for i in range(10)))
    (root / "scripts/setup_cpu.sh").write_text("exit 0\n")
    (root / "scripts/sft_coldstart.sh").write_text('mkdir -p "$1/hf"; echo {} > "$1/hf/config.json"; '
                                                   'touch "$1/hf/model.safetensors"\n')
    py = root / ".venv/bin/python"
    py.write_text(_STUB_PY)
    py.chmod(0o755)
    git = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "stub"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return root, head, {**os.environ, "REAL_PY": sys.executable, "DEV_ROWS": "2", "OUT": "runs/lp"}


def test_sweep_mode_records_and_interleaving_without_training(tmp_path):
    """Issue 41's script paths, with train.py and eval.py stubbed: a sweep candidate (HELDOUT_EVAL=0) trains, reads
    the dev split in the run and at its milestone, evaluates no held-out set and writes no report; every launch
    leaves its commit and command line in run_meta.jsonl; the rungs run seed by seed; PROTOCOL refuses to start
    while the protocol's SSP recipe is not chosen."""
    root, head, env = _stub_repo(tmp_path)
    run = lambda **kw: subprocess.run(["bash", "scripts/learning_proof_cpu.sh"], cwd=root, env={**env, **kw},  # noqa: E731
                                      capture_output=True, text=True, timeout=120)
    r = run(RUNGS="2", SEEDS="101 102", STEPS="30", DEV_EVERY="10", HELDOUT_EVAL="0", SSP_PREFIX="sweep_B_seed",
            SSP_EXTRA="--rag_verify retrieval")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = root / "runs/lp"
    assert "TRAIN runs/lp/sweep_B_seed101 30" in r.stdout and "EVAL runs/lp/sweep_B_seed102/dev_step30" in r.stdout
    assert not (out / "eval_sft").exists() and "eval_step" not in r.stdout and "STUB bench/learning_proof.py" not in r.stdout
    meta = [json.loads(x) for x in (out / "sweep_B_seed101/run_meta.jsonl").read_text().splitlines()]
    assert len(meta) == 1 and meta[0]["commit"] == head and meta[0]["dirty"] is False
    argv = meta[0]["argv"]
    assert argv[1] == "train.py" and argv[argv.index("--eval_every") + 1] == "10"
    assert [argv[i + 1] for i, x in enumerate(argv) if x == "--rag_verify"][-1] == "retrieval"   # the candidate's flag wins
    assert json.loads((out / "sweep_B_seed101/dev_step30/run_meta.jsonl").read_text())["argv"][1] == "eval.py"

    r = run(OUT="runs/lp2", RUNGS="1 2", SEEDS="1 2", QA_STEPS="3", STEPS="4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    order = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("TRAIN")]
    assert order == ["runs/lp2/qa_seed1", "runs/lp2/seed1", "runs/lp2/qa_seed2", "runs/lp2/seed2"]

    r = run(OUT="runs/lp3", PROTOCOL="bench/learning_protocol.json")
    assert r.returncode != 0 and "not chosen yet" in r.stderr and "TRAIN" not in r.stdout


def _launches(folder: Path) -> list[list[str]]:
    """The command lines the script recorded for the launches into one folder (run_meta.jsonl)."""
    return [json.loads(x)["argv"] for x in (folder / "run_meta.jsonl").read_text().splitlines()]


def _train_config(argv: list[str]):
    """What train.py makes of a recorded command line: its own parser and defaults (no file checks)."""
    from training.settings.config import config_from_flags
    assert argv[1] == "train.py", argv
    return config_from_flags(argv[2:])


def test_rungs_0_1gae_and_3_pass_their_settings_to_eval_and_train(tmp_path):
    """Every rung of the default ladder, with train.py and eval.py stubbed: rung 0 evaluates the SFT export greedily
    and at temperature 1 with PASSK samples, on the dev split and on the first PASSK_LIMIT rows of every held-out
    file; rung 1gae is rung 1's recipe with GAE and a critic of its own LR on the top 8 layers, run before rung 1;
    rung 3 is rung 2's game plus --distill; every rung starts from the one SFT export; SSP and distillation are
    read on the dev split at their last milestone; the report is asked for every rung that ran."""
    root, _, env = _stub_repo(tmp_path)
    r = subprocess.run(["bash", "scripts/learning_proof_cpu.sh"], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**env, "RUNGS": "0 1gae 1 2 3", "SEEDS": "1", "QA_STEPS": "3", "GAE_STEPS": "2",
                            "STEPS": "4", "DISTILL_STEPS": "5", "PASSK": "4", "PASSK_LIMIT": "7"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = root / "runs/lp"
    sft = "runs/lp/sft/hf"   # SFT_DIR defaults to <OUT>/sft, made by the stubbed sft_coldstart.sh (paths as typed)

    # rung 0: four evals of the SFT export
    heldout = [f"data/eval/{n}.jsonl" for n in ("reading_heldout", "twohop_heldout", "capitals", "fanoutqa_singlehop",
                                                "fanoutqa_multihop", "wiki_desc_heldout")]
    for name, sampled, data in (("eval_sft_dev", False, "dev"), ("passk_dev", True, "dev"),
                                ("eval_sft_slice", False, "slice"), ("passk_slice", True, "slice")):
        (argv,) = _launches(out / name)
        assert argv[1] == "eval.py" and argv[argv.index("--model") + 1] == sft, (name, argv)
        files = argv[argv.index("--data") + 1:]
        files = files[:next((i for i, a in enumerate(files) if a.startswith("--")), len(files))]
        if data == "dev":
            assert files == ["runs/lp/qa_dev.jsonl"] and "--limit" not in argv, (name, argv)
        else:
            assert files == heldout and argv[argv.index("--limit") + 1] == "7", (name, argv)
        if sampled:
            assert [argv[argv.index(f) + 1] for f in ("--samples", "--temperature", "--seed")] == ["4", "1.0", "1"]
        else:
            assert "--samples" not in argv and "--temperature" not in argv, (name, argv)

    # the RL rungs: one launch each, from the one SFT start, in the order 1gae, 1, 2, 3
    trains = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("TRAIN")]
    assert trains == [f"runs/lp/{p}1" for p in ("qa_gae_seed", "qa_seed", "seed", "distill_seed")], trains
    cfg = {p: _train_config(_launches(out / f"{p}1")[0]) for p in ("qa_gae_seed", "qa_seed", "seed", "distill_seed")}
    gae, qa, ssp, dist = cfg["qa_gae_seed"], cfg["qa_seed"], cfg["seed"], cfg["distill_seed"]
    assert {c.model.model_path for c in cfg.values()} == {sft}
    assert [c.optimisation.total_steps for c in (gae, qa, ssp, dist)] == [2, 3, 4, 5]
    assert gae.algorithm.solver_estimator == "gae" and qa.algorithm.solver_estimator == "grpo"
    assert gae.critic.critic_train_top_layers == 8 and gae.critic.critic_lr == 1e-4
    assert gae.critic.critic_gradient_checkpointing is False
    assert not gae.selfplay.self_play_enable and not qa.selfplay.self_play_enable
    assert gae.selfplay.qa_data == qa.selfplay.qa_data == "runs/lp/qa_train.jsonl"
    assert ssp.selfplay.self_play_enable and dist.selfplay.self_play_enable
    assert (dist.distill.distill, dist.distill.distill_coef, dist.distill.distill_context_tokens) == ("sampled", 0.1, 512)
    assert ssp.distill.distill == "off" and dist.selfplay == ssp.selfplay   # rung 3 plays rung 2's game
    for c in (qa, ssp, dist):   # the rest of the recipe is rung 1gae's: the critic is the only change
        assert (c.optimisation, c.rollout) == (replace(gae.optimisation, total_steps=c.optimisation.total_steps),
                                              gae.rollout)

    # held-out evals at every milestone; the dev split at the last one for the SSP rungs only
    for p, m in (("qa_gae_seed", 2), ("qa_seed", 3), ("seed", 4), ("distill_seed", 5)):
        (argv,) = _launches(out / f"{p}1" / f"eval_step{m}")
        assert argv[argv.index("--model") + 1] == f"runs/lp/{p}1/checkpoints/step_{m:06d}/hf"
        assert (out / f"{p}1" / f"dev_step{m}").exists() == (p in ("seed", "distill_seed")), p
    (report,) = [line for line in r.stdout.splitlines() if line.startswith("STUB bench/learning_proof.py")]
    assert report.split()[2:] == ["--out", "runs/lp", "--seeds", "1", "--name", "learning", "--png",
                                  "bench/learning_proof.png", "--passk", "4", "--qa_steps", "3", "--qa_gae_steps", "2",
                                  "--steps", "4", "--distill_steps", "5"], report
    stages = [line.split("\t")[0] for line in (out / "timings.tsv").read_text().splitlines()]
    assert stages == ["sft", "eval_sft", "headroom", "rl_qa_gae", "eval_qa_gae_step2", "rl_qa", "eval_qa_step3", "rl",
                      "eval_step4", "rl_distill", "eval_distill_step5"], stages
