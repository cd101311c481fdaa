"""Shell scripts: every one parses (`bash -n`), the per-model-size launchers refuse a missing hostfile,
and each of them reaches a successful `train.py --dry_run` through the real deepspeed launcher."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))
MODEL_SCRIPTS = [p for p in SCRIPTS if p.name.startswith("train_") and p.name != "train_common.sh"]


def test_there_are_scripts_for_each_model_size():
    names = {p.stem for p in MODEL_SCRIPTS}
    for size in ("qwen2.5_3b", "qwen2.5_7b", "qwen2.5_14b", "qwen2.5_32b"):
        assert f"train_{size}_instruct" in names and f"train_{size}_base" in names
    assert {"train_llama3.1_8b_instruct", "train_qwen3_8b"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", MODEL_SCRIPTS, ids=lambda p: p.name)
def test_model_script_needs_a_hostfile(script, tmp_path):
    r = subprocess.run(["bash", str(script), str(tmp_path / "no_such_hostfile")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=30)
    assert r.returncode == 2
    assert "usage:" in r.stderr and "HOSTFILE" in r.stderr


def _script_defaults(script: Path) -> dict[str, str]:
    """The `export VAR=${VAR:-default}` lines of a model script."""
    return dict(re.findall(r"^export (\w+)=\$\{\w+:-(.*)\}$", script.read_text(), re.M))


@pytest.mark.parametrize("script", MODEL_SCRIPTS, ids=lambda p: p.name)
def test_model_script_template_is_a_real_choice(script):
    """argparse exits 2 on an unknown --template (the base-model scripts once said 'rsearch')."""
    from training.settings.config import ModelArgs
    choices = ModelArgs.__dataclass_fields__["template"].metadata["choices"]
    assert _script_defaults(script)["TEMPLATE"] in choices


@pytest.mark.parametrize("script", MODEL_SCRIPTS, ids=lambda p: p.name)
def test_models_with_a_chat_template_use_it(script):
    """A model that ships a chat template is prompted through it (TEMPLATE=auto); the hand-written strings
    are tested only against themselves, so only base models (no template) default to the plain r_search."""
    want = "r_search" if script.stem.endswith("_base") else "auto"
    assert _script_defaults(script)["TEMPLATE"].split()[0] == want


# ----------------------------------------------------------------------------- --model_path: hub ids

def _validate_model_path(path: str, monkeypatch, offline: str | None):
    from training.settings.config import Config, ConfigError, validate_args
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    if offline is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    cfg = Config()
    cfg.model.model_path = path
    cfg.search.retriever_url = "http://127.0.0.1:8000"
    cfg.selfplay.train_data = __file__
    try:
        validate_args(cfg)
        return ""
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("offline", [None, "0", "false"])
def test_hub_id_is_accepted_when_the_hub_is_on(monkeypatch, offline):
    assert _validate_model_path("Qwen/Qwen2.5-7B", monkeypatch, offline) == ""


@pytest.mark.parametrize("offline", ["1", "TRUE", "yes"])
def test_hub_id_is_refused_offline_with_the_fix(monkeypatch, offline):
    msg = _validate_model_path("Qwen/Qwen2.5-7B", monkeypatch, offline)
    assert "--model_path Qwen/Qwen2.5-7B is not a local folder, and the hub is offline" in msg
    assert "huggingface-cli download Qwen/Qwen2.5-7B" in msg and "prepare_data.py" not in msg


@pytest.mark.parametrize("offline", [None, "1"])
def test_sft_takes_the_same_model_path_rule(monkeypatch, offline, tmp_path):
    """training/loop/sft.py once refused every hub id as 'does not exist'."""
    from training.settings.config import ConfigError
    from training.loop.sft import parse_sft_args
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    (tmp_path / "demos.jsonl").write_text("")
    argv = ["--model_path", "Qwen/Qwen2.5-7B", "--data", str(tmp_path / "demos.jsonl"), "--output_dir", str(tmp_path / "o")]
    if offline:
        with pytest.raises(ConfigError, match="is not a local folder, and the hub is offline"):
            parse_sft_args(argv)
    else:
        parse_sft_args(argv)


@pytest.mark.parametrize("path", ["/models/qwen-7b", "data/models/no-such-model", "./no-such-model",
                                  "tests/no-such-model", "a/b/c", "org/../name"])
def test_missing_local_path_is_still_refused(monkeypatch, path):
    """Not hub-shaped (one 'org/name' whose 'org' is no local folder): a missing folder, even online."""
    assert f"--model_path {path} does not exist" in _validate_model_path(path, monkeypatch, None)


# ----------------------------------------------------------------------------- optimizer offload (the 32B scripts)

def test_optimizer_offload_gets_deepspeeds_cpu_adam(monkeypatch):
    """deepspeed.initialize refuses a torch optimizer under offload (ZeRORuntimeException). The real
    DeepSpeedCPUAdam JIT-builds for ~150 s, so it is stubbed here; `train.py --dry_run_build_ops
    --offload_optimizer true` runs the real one (measured: 110 s wall, exit 0)."""
    import deepspeed.ops.adam
    import torch

    from training.settings.config import Config
    from training.engine.engine_builder import make_optimizer

    class StubCPUAdam:
        def __init__(self, params, **kw):
            self.params, self.kw = list(params), kw

    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", StubCPUAdam)
    cfg = Config()
    cfg.optimisation.lr, cfg.optimisation.weight_decay = 3e-6, 0.1
    params = list(torch.nn.Linear(2, 2).parameters())
    plain = make_optimizer(cfg, params)
    assert type(plain) is torch.optim.AdamW and plain.defaults["lr"] == 3e-6
    cfg.deepspeed.offload_optimizer = True
    off = make_optimizer(cfg, params)
    assert isinstance(off, StubCPUAdam) and off.kw == {"lr": 3e-6, "weight_decay": 0.1, "adamw_mode": True}


# ----------------------------------------------------------------------------- train.py --dry_run

def _env(**kw) -> dict:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"), PYTHONUNBUFFERED="1")
    env.update(kw)
    return env


def _printed_configs(out: str) -> tuple[dict, dict]:
    """The resolved config and the actor's DeepSpeed config, as the dry run prints them."""
    cfg = out.split("train.py --dry_run: resolved config\n", 1)[1]
    cfg, ds = cfg.split("DeepSpeed config (actor)\n", 1)
    ds = ds[:ds.index("\n}\n") + 2]
    return json.loads(cfg), json.loads(ds)


def _script_flags(script: Path, **env) -> list[str]:
    """The train.py flags a model script passes (bash with a stand-in `deepspeed` that prints them)."""
    (tmp := Path(env.pop("tmp"))).mkdir(exist_ok=True)
    fake = tmp / "deepspeed"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@"\n')
    fake.chmod(0o755)
    (tmp / "hostfile").write_text("localhost slots=8\n")
    full = {k: v for k, v in os.environ.items() if k not in ("TRAIN_DATA", "MODEL", "RETRIEVER_URL")}
    full.update(PATH=f"{tmp}{os.pathsep}{os.environ['PATH']}", DRY_RUN="1", **env)
    r = subprocess.run(["bash", str(script), str(tmp / "hostfile")], capture_output=True, env=full, timeout=60, cwd=tmp)
    assert r.returncode == 0, r.stderr.decode()
    args = r.stdout.decode().split("\0")[:-1]
    return args[args.index("train.py") + 1:]


def test_model_scripts_accept_the_demo_answer_pool_only_when_train_data_is_unset(tmp_path):
    """The one demo default the scripts fall back on is --train_data: they say so with
    --allow_demo_defaults true; given TRAIN_DATA, they pass it and no such flag. Their model and
    retriever are never the demo's."""
    from training.settings.config import Config
    script = REPO / "scripts" / "train_qwen2.5_7b_instruct.sh"
    demo = _script_flags(script, tmp=str(tmp_path / "a"))
    assert demo[demo.index("--train_data") + 1] == Config().selfplay.train_data
    assert demo[demo.index("--allow_demo_defaults") + 1] == "true"
    assert demo[demo.index("--model_path") + 1] != Config().model.model_path and demo[demo.index("--retriever_url") + 1]
    own = _script_flags(script, tmp=str(tmp_path / "b"), TRAIN_DATA="/data/ssp/train.parquet")
    assert own[own.index("--train_data") + 1] == "/data/ssp/train.parquet" and "--allow_demo_defaults" not in own


def test_model_scripts_pass_report_to(tmp_path):
    """REPORT_TO reaches train.py as --report_to (default tensorboard, as train.py's own), and the demo passes it
    to training and to eval alike."""
    script = REPO / "scripts" / "train_qwen2.5_7b_instruct.sh"
    plain = _script_flags(script, tmp=str(tmp_path / "a"))
    assert plain[plain.index("--report_to") + 1] == "tensorboard"
    both = _script_flags(script, tmp=str(tmp_path / "b"), REPORT_TO="tensorboard,wandb,mlflow")
    assert both[both.index("--report_to") + 1] == "tensorboard,wandb,mlflow"
    demo = (REPO / "scripts" / "demo_cpu.sh").read_text()
    assert demo.count('--report_to "$REPORT_TO"') == 2 and "REPORT_TO=${REPORT_TO:-tensorboard}" in demo


def test_dry_run_refuses_demo_defaults_across_nodes(tmp_path):
    """Local rank 0 of a 2-node launch (WORLD_SIZE 16, 8 local ranks) on the CPU demo's defaults:
    one refusal naming each default and the flag that replaces it."""
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--dry_run", "--output_dir", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env=_env(WORLD_SIZE="16", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8"))
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "this run is across nodes, but would train with the CPU demo's defaults" in err
    for flag in ("--model_path data/models/SmolLM2-135M-Instruct", "--index data/indexes/bm25",
                 "--train_data data/train/proposer.jsonl", "--allow_demo_defaults true"):
        assert flag in err, err
    assert "dry run: ok" not in r.stdout


def test_readme_gpu_command_passes_a_dry_run_at_8_ranks(tmp_path):
    """README's `torchrun --nproc_per_node 8 train.py --model_path ... --retriever_url ...` with its own
    answer pool: the default --prompts_per_step (auto) becomes 4 per rank, 32, and passes."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "Paris", "search_turns": 2}\n')
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--dry_run", "--model_path", "Qwen/Qwen2.5-7B-Instruct",
                        "--retriever_url", "http://127.0.0.1:8000", "--train_data", str(rows),
                        "--output_dir", str(tmp_path / "runs/qwen7b")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env=_env(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg, _ = _printed_configs(r.stdout)
    assert cfg["selfplay"]["prompts_per_step"] == 32 and cfg["selfplay"]["allow_demo_defaults"] is False
    assert "demo defaults" not in r.stdout and r.stdout.rstrip().endswith("dry run: ok")


def test_dry_run_refuses_what_the_launcher_world_cannot_run(tmp_path):
    """--vllm_tp 4 in a world of 2 (the launcher's WORLD_SIZE): refused before anything heavy is imported."""
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--dry_run", "--model_path", "Qwen/Qwen2.5-32B",
                        "--retriever_url", "http://127.0.0.1:8000", "--vllm_tp", "4", "--prompts_per_step", "8"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env=_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--vllm_tp 4 must divide the world size 2" in r.stderr
    assert "dry run: ok" not in r.stdout


def test_dry_run_in_a_world_of_one_lists_what_it_could_not_check(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--dry_run", "--model_path", "Qwen/Qwen2.5-7B",
                        "--retriever_url", "http://127.0.0.1:8000", "--train_data", str(tmp_path / "nope.jsonl"),
                        "--kl_coef", "0.01"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world size: unknown" in r.stdout
    unchecked = [ln for ln in r.stdout.splitlines() if ln.startswith("not checked here")]
    assert len(unchecked) == 2 and "hub is offline" in unchecked[0] and "nope.jsonl does not exist" in unchecked[1]
    assert "DeepSpeed config (reference)" in r.stdout and "actor and reference config accepted" in r.stdout
    assert r.stdout.rstrip().endswith("dry run: ok")


# Two scripts go through the launcher with ESTIMATOR=gae (PPO's critic, its optimizer offloaded by the 14B one's
# default): that launch checks their own defaults and the critic's DeepSpeed config in one start-up, where a
# second launch of the same script cost one more (~15-30 s each).
GAE_LAUNCHES = ("train_qwen2.5_3b_instruct.sh", "train_qwen2.5_14b_base.sh")
# The real `deepspeed --hostfile` launcher starts these three, one per DeepSpeed shape the scripts make (a critic
# beside the actor; the critic's optimizer offloaded; the actor's offloaded, at vLLM TP 4). The others run as the
# launcher's local rank 0 of 8 (its environment, tests/test_scripts.py RANK0_OF_8): the same train.py --dry_run and
# the same printed config, without the launcher's own two start-ups and seven idle ranks (~12 s a script, issue 43).
REAL_LAUNCHES = GAE_LAUNCHES + ("train_qwen2.5_32b_base.sh",)
RANK0_OF_8 = """#!/usr/bin/env bash
# local rank 0 of the 8 that `deepspeed --hostfile H [launcher flags] train.py ...` starts on this node
while [ "$1" != train.py ]; do shift; done
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=8 CROSS_RANK=0 CROSS_SIZE=1 LOCAL_SIZE=8 RANK=0 LOCAL_RANK=0
exec python -u "$@"
"""


@pytest.mark.slow
def test_every_model_script_passes_a_dry_run_as_rank_0_of_8(tmp_path):
    """Each scripts/train_*.sh, as a user starts it (scripts sized for 8-GPU nodes: vLLM TP 4 needs a world it
    divides): REAL_LAUNCHES through `deepspeed --hostfile` with 8 local ranks (only local rank 0 imports DeepSpeed),
    the rest as that rank 0. The scripts of GAE_LAUNCHES run with ESTIMATOR=gae: the critic's config is accepted
    beside the actor's, its memory plan printed, and its optimizer offloaded where the script says so."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=8\n")
    from utils.dist import free_port

    rank0 = tmp_path / "rank0"
    rank0.mkdir()
    (rank0 / "deepspeed").write_text(RANK0_OF_8)
    (rank0 / "deepspeed").chmod(0o755)
    assert set(REAL_LAUNCHES) <= {p.name for p in MODEL_SCRIPTS}
    failures = []
    for script in MODEL_SCRIPTS:
        want, gae = _script_defaults(script), script.name in GAE_LAUNCHES
        env = _env(DRY_RUN="1", OUT=str(tmp_path / "out" / script.stem),
                   LAUNCHER_ARGS=f"--no_ssh_check --master_addr 127.0.0.1 --master_port {free_port()}")
        for k in ("MODEL", "TEMPLATE", "VLLM_TP", "PROMPTS_PER_STEP", "OFFLOAD", "CRITIC_OFFLOAD", "GPU_MEM",
                  "WORLD_SIZE", "RANK", "LOCAL_RANK", "ESTIMATOR"):
            env.pop(k, None)
        if gae:
            env["ESTIMATOR"] = "gae"
        if script.name not in REAL_LAUNCHES:
            env["PATH"] = f"{rank0}{os.pathsep}{env['PATH']}"
        r = subprocess.run(["bash", str(script), str(hostfile)], capture_output=True, text=True, cwd=tmp_path,
                           timeout=300, env=env)
        if r.returncode != 0 or "dry run: ok" not in r.stdout:
            failures.append(f"{script.name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            continue
        cfg, ds = _printed_configs(r.stdout)
        assert cfg["model"]["model_path"] == want["MODEL"] and cfg["model"]["template"] == want["TEMPLATE"]
        assert cfg["rollout"]["vllm_tp"] == int(want["VLLM_TP"])
        assert cfg["deepspeed"]["offload_optimizer"] == (want["OFFLOAD"] == "true")
        assert ("offload_optimizer" in ds["zero_optimization"]) == (want["OFFLOAD"] == "true")
        assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True
        assert "world size: 8 (the launcher's)" in r.stdout
        assert cfg["selfplay"]["prompts_per_step"] == int(want["PROMPTS_PER_STEP"])
        # TRAIN_DATA unset: the demo answer pool, accepted on purpose (a GPU run would refuse it otherwise)
        assert cfg["selfplay"]["allow_demo_defaults"] is True and "demo defaults accepted on purpose" in r.stdout
        assert re.search(r"^disk: one save [\d.]+ GB, --max_ckpts 3 kept: [\d.]+ GB", r.stdout, re.M), r.stdout[-3000:]
        assert ("DeepSpeedCPUAdam" in r.stdout) == (want["OFFLOAD"] == "true")
        assert not (tmp_path / "out" / script.stem).exists(), "a dry run writes no output dir"
        assert cfg["algorithm"]["solver_estimator"] == ("gae" if gae else "grpo"), script.name
        assert ("DeepSpeed config (critic)" in r.stdout) == gae, script.name
        if gae:
            assert "actor and critic config accepted" in r.stdout
            assert re.search(r"critic \([\d.]+B\): params \+ grads", r.stdout), r.stdout[-3000:]
            assert cfg["critic"]["critic_offload_optimizer"] == (want.get("CRITIC_OFFLOAD", want["OFFLOAD"]) == "true")
    assert not failures, "\n\n".join(failures)


def test_model_scripts_take_estimator_gae_and_its_plan_fits_8x80gb(tmp_path):
    """ESTIMATOR=gae: the solver's estimator is gae (the proposer keeps reinforce++), the critic gets its LR
    and the memory plan, which counts the critic, warns for no script (the 14B ones offload its optimizer)."""
    from training.engine import memory_plan as mp
    from training.settings.config import config_from_flags

    for script in MODEL_SCRIPTS:
        argv = _script_flags(script, tmp=str(tmp_path / script.stem), ESTIMATOR="gae")
        cfg = config_from_flags(argv[:-1] if argv[-1] == "--dry_run" else argv)
        assert cfg.algorithm.solver_estimator == "gae" and cfg.algorithm.proposer_estimator == "reinforce++"
        assert cfg.critic.critic_lr == 1e-5
        pl = mp.plan(cfg, 8, 8)
        assert pl["train"]["critic"] > 0 or cfg.critic.critic_offload_optimizer, script.name
        assert pl["warnings"] == [], (script.name, pl["warnings"])
    plain = _script_flags(MODEL_SCRIPTS[0], tmp=str(tmp_path / "plain"))
    assert plain[plain.index("--solver_estimator") + 1] == "grpo" and "--critic_lr" not in plain
