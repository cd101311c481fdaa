"""Search Self-Play (SSP) on DeepSpeed: one LLM, two roles (proposer, solver), one search engine.

Launch (every rank runs this same program: a ZeRO-3 actor shard, an in-process vLLM
engine, its share of the games, the packed loss, checkpointing):

    # GPU cluster: one line per node in the hostfile ("node1 slots=8"). On CUDA or across nodes the
    # CPU demo's defaults (--model_path, --index without --retriever_url, --train_data) are refused:
    # pass your own, or --allow_demo_defaults true. --output_dir must be on a filesystem every node
    # mounts (checked at start-up). --prompts_per_step defaults to 4 per data-parallel group.
    deepspeed --hostfile hostfile train.py --model_path Qwen/Qwen2.5-7B-Instruct \
        --retriever_url http://127.0.0.1:8000 --train_data /data/ssp/proposer.parquet --output_dir runs/qwen7b
    # one node, N ranks
    torchrun --nproc_per_node 8 train.py ...
    # CPU, 2 ranks over gloo (what scripts/demo_cpu.sh runs)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 train.py --dtype fp32 --prompts_per_step 2 ...
    # plain python: a world of one
    python train.py --dtype fp32 ...
    # check a command line without training: parse, validate, print the resolved config and the
    # DeepSpeed config, and pass that config through deepspeed.initialize on a stand-in model
    DRY_RUN=1 bash scripts/train_qwen2.5_7b_instruct.sh hostfile     # = train.py ... --dry_run

Against the SSP paper's veRL release:
  * PPO mini-batch epochs are flags (--ppo_epochs, --ppo_mini_batches; default one optimizer step
    per game). Old log-probs are recomputed by the actor after generation (or taken from vLLM:
    --old_logprobs rollout); actor/rollout_lp_gap measures the rollout-vs-actor gap by a forward.
  * a critic for PPO: estimator "gae" (per role) builds one beside the actor (training/algorithm/critic.py),
    as veRL's adv_estimator=gae; docs/training.md, "PPO with a critic".
  * search backends per role: retriever, simulated (ZeroSearch; an LLM writes the documents),
    self (SSRL) or none.
  * failures do not train: groups whose judging or search failed are left out of the loss, and
    the run stops past --max_failed_share; an optimizer step with non-finite inputs or log-probs
    is skipped on every rank, and --max_nonfinite_steps in a row stop the run.

`python train.py --help` lists every flag, grouped. Resume after any crash with the same
command line: --resume auto (the default) picks up the latest complete checkpoint. A mistake in the
input (a row file, the model folder, the index, the run folder) is one message before torch is
imported or the model built; docs/TROUBLESHOOTING.md lists them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

# Project modules that load no torch / vLLM / DeepSpeed, so --help and a refused input stay fast: the heavy ones
# (training.engine.engine_builder and training.loop.trainer import torch) are imported where they are used.
from training.settings.config import (GROUPS, Config, ConfigError, build_parser, groups_from_namespace, needs_critic,
                             needs_reference, parse_config, resolve_defaults, validate_args)
from training.settings.launch_env import cuda_present, demo_default_errors, demo_defaults_in_use, node_count
from training.engine.memory_plan import dry_run_report
from training.settings.preflight import input_errors, preflight
from training.engine.run_state import run_folder_errors
from utils.dist import free_port, init_distributed, prepare_launch_env
from utils.errors import InputError
from utils.logging import configure_logging

# Environment that must be in place before torch / vLLM / DeepSpeed are imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process, not a child
prepare_launch_env()
DESCRIPTION = (__doc__.split("\n")[0] + " Also: --dry_run checks the command line and the DeepSpeed config, "
               "then exits (--dry_run_build_ops also builds DeepSpeed's CPU-Adam op when offload needs it).")


# (group, flag) of every path validate_args looks for on disk.
PATH_FLAGS = (("model", "model_path"), ("selfplay", "train_data"), ("selfplay", "qa_data"),
              ("selfplay", "pool_init"), ("search", "index"), ("critic", "critic_model_path"))


def split_own_flags(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """train.py's own flags (not part of the Config, so not in config.json); the rest is the Config's."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--dry_run_build_ops", action="store_true")
    return p.parse_known_args(sys.argv[1:] if argv is None else argv)


def config_errors(cfg, world_size: int | None, cuda: bool | None = None, multi_node: bool | None = None) -> list[str]:
    try:
        validate_args(cfg, world_size, cuda=cuda, multi_node=multi_node)
        return []
    except ConfigError as e:
        return str(e).split("\n  - ")[1:]


def dry_run(argv: list[str], build_ops: bool) -> int:
    """Check a command line where it is typed (a laptop, a login node, every node of the launch):
    everything validate_args checks, against the launcher's world size, except files that are not on
    this machine, which are listed instead; the CPU demo's defaults, refused on CUDA or across nodes
    (the launcher's environment says which) and listed otherwise; the inputs that are here, read as the
    launch reads them (training/settings/preflight.py) and the run folder as the launch would claim it (read-only,
    training/engine/run_state.py); then print the resolved config, the
    memory plan with the checkpoint disk, and the DeepSpeed config,
    and pass that config, with the run's optimizer, through deepspeed.initialize and one step on a
    stand-in model at world size 1. Only local rank 0 of each node prints and runs DeepSpeed: the
    other ranks validate and exit, and nobody joins the launcher's process group."""
    ns = build_parser(DESCRIPTION).parse_args(argv)  # parse_config without its validate_args
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    cfg = resolve_defaults(Config(**groups_from_namespace(GROUPS, ns)), world_size=world)
    cuda, nodes = cuda_present(), node_count()
    # Refusals that go away when every missing path is swapped for one that exists are about
    # files that are not on this machine: reported, not fatal. Everything else is fatal. The demo
    # defaults are judged on the paths as typed (a swapped path is no longer the default).
    probe, typed = copy.deepcopy(cfg), copy.deepcopy(cfg)
    for group, flag in PATH_FLAGS:
        path = getattr(getattr(cfg, group), flag)
        if path and not Path(path).exists():
            setattr(getattr(probe, group), flag, __file__)
    probe.selfplay.allow_demo_defaults = typed.selfplay.allow_demo_defaults = True
    errors = config_errors(probe, world, cuda, nodes > 1) + demo_default_errors(cfg, cuda, nodes > 1)
    # what the launch reads before its model: the row files, model folder and index that are here (read whole),
    # and the run folder (another run's, --resume none on checkpoints, a damaged checkpoint); nothing is written
    auto_b = ("selfplay.prompts_per_step",) if ns.prompts_per_step == 0 else ()  # the launch keeps the run's own
    errors += input_errors(cfg)[1] + run_folder_errors(cfg.logging.output_dir, cfg.to_dict(), ignore=auto_b)
    unchecked = [e for e in config_errors(typed, world, cuda, nodes > 1) if e not in errors]
    local_rank = int(os.environ.get("LOCAL_RANK", max(cfg.deepspeed.local_rank, 0)))
    if local_rank != 0:
        return 1 if errors else 0
    if errors:
        print("train.py --dry_run: invalid configuration:\n  - " + "\n  - ".join(errors), file=sys.stderr)
        return 1

    from training.engine.engine_builder import build_ds_config, critic_ds_config  # lazy: imports torch

    ds_cfgs = {"actor": build_ds_config(cfg, train=True)}
    if needs_reference(cfg):
        ds_cfgs["reference"] = build_ds_config(cfg, train=False, offload_param=cfg.deepspeed.ref_offload)
    if needs_critic(cfg):
        ds_cfgs["critic"] = critic_ds_config(cfg)
    print("train.py --dry_run: resolved config\n" + json.dumps(cfg.to_dict(), indent=2))
    for name, ds in ds_cfgs.items():
        print(f"DeepSpeed config ({name})\n" + json.dumps(ds, indent=2))
    print(f"world size: {world} (the launcher's): --vllm_tp and --prompts_per_step were checked against it"
          if world else "world size: unknown (not started by a launcher): --vllm_tp / --prompts_per_step not checked"
          + ("; --prompts_per_step 0 (auto) becomes 4 per data-parallel group at launch"
             if cfg.selfplay.prompts_per_step == 0 else ""))
    for e in unchecked:
        print(f"not checked here (not on this machine; a run here would refuse it): {e}")
    demo = demo_defaults_in_use(cfg)
    where = ", ".join(w for w, on in (("CUDA", cuda), (f"{nodes} nodes", nodes > 1)) if on) or "CPU, one node"
    if demo and cfg.selfplay.allow_demo_defaults:
        print(f"demo defaults accepted on purpose (--allow_demo_defaults true; {where}):\n  " + "\n  ".join(demo))
    elif demo:
        print(f"demo defaults in use ({where}: fine here; a run on CUDA or across nodes refuses them unless "
              f"--allow_demo_defaults true):\n  " + "\n  ".join(demo))
    local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    print(dry_run_report(cfg, world, int(local) if local else None))  # before deepspeed_check sets WORLD_SIZE=1
    for line in deepspeed_check(cfg, ds_cfgs, build_ops):
        print(line)
    print("dry run: ok")
    return 0


def deepspeed_check(cfg, ds_cfgs: dict, build_ops: bool) -> list[str]:
    """deepspeed.initialize + one step on a stand-in nn.Linear, in a process group of one of this
    process's own (the launcher's rendezvous is never joined), so DeepSpeed config errors surface."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", CROSS_RANK="0", CROSS_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # Under torchrun the env:// rendezvous would join the agent's store as a client, at a port where none
    # listens now, and wait there (the README's torchrun line hung for 12 minutes): make this group its own.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    init_distributed()
    import deepspeed
    import torch

    from training.engine.engine_builder import make_optimizer  # imports torch

    lines, ds = [], dict(ds_cfgs["actor"])
    model = torch.nn.Linear(16, 16)
    opt_name = "DeepSpeedCPUAdam (optimizer offload)" if cfg.deepspeed.offload_optimizer else "torch.optim.AdamW"
    if cfg.deepspeed.offload_optimizer and not build_ops and not cpu_adam_prebuilt():
        # Building CPU-Adam costs ~150 s of gcc: check the op can build here, and run the rest
        # of the config with torch AdamW in its place (the only key that changes is this one).
        from deepspeed.ops.op_builder import CPUAdamBuilder
        ok = CPUAdamBuilder().is_compatible()
        lines.append(f"optimizer: {opt_name}; its cpu_adam op is {'buildable' if ok else 'NOT buildable'} here and "
                     f"was not built (--dry_run_build_ops builds it, ~150 s); the check below ran torch AdamW with "
                     f"zero_force_ds_cpu_optimizer=false in its place")
        if not ok:
            raise SystemExit("train.py --dry_run: DeepSpeed's cpu_adam op cannot be built on this machine")
        ds["zero_force_ds_cpu_optimizer"] = False
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimisation.lr)
    else:
        lines.append(f"optimizer: {opt_name}")
        opt = make_optimizer(cfg, list(model.parameters()))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    x = torch.randn(4, 16, dtype=dtype, device=engine.device)  # (B, H)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    if "reference" in ds_cfgs:
        ref, *_ = deepspeed.initialize(model=torch.nn.Linear(16, 16), config=ds_cfgs["reference"])
        with torch.no_grad():
            ref(x)
    if "critic" in ds_cfgs:  # its own optimizer; CPU-Adam under --critic_offload_optimizer, checked as the actor's
        c, critic_model = cfg.critic, torch.nn.Linear(16, 1)
        ds_c, offload = dict(ds_cfgs["critic"]), c.critic_offload_optimizer and (build_ops or cpu_adam_prebuilt())
        if c.critic_offload_optimizer and not offload:
            ds_c["zero_force_ds_cpu_optimizer"] = False
        opt = make_optimizer(cfg, list(critic_model.parameters()), lr=c.critic_lr, offload=offload)
        critic, *_ = deepspeed.initialize(model=critic_model, optimizer=opt, config=ds_c)
        critic.backward(critic(x).float().pow(2).mean())
        critic.step()
    lines.append(f"deepspeed.initialize + one step on a stand-in nn.Linear (world size 1, {engine.device}): ok, "
                 f"{' and '.join(ds_cfgs)} config accepted")
    return lines


def cpu_adam_prebuilt() -> bool:
    """True when DeepSpeed was installed with the cpu_adam op compiled for this accelerator
    (DS_BUILD_CPU_ADAM=1 pip install deepspeed), so loading it costs no build."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    return bool(installed_ops.get("cpu_adam")) and accelerator_name == get_accelerator()._name


def main(argv: list[str] | None = None) -> None:
    own, argv = split_own_flags(argv)
    if own.dry_run or own.dry_run_build_ops:
        sys.exit(dry_run(argv, own.dry_run_build_ops))
    configure_logging(int(os.environ.get("RANK", "0")))   # the launchers set RANK before the process starts
    try:  # a mistake in the user's input is one message (docs/TROUBLESHOOTING.md); anything else keeps its traceback
        cfg = parse_config(argv, description=DESCRIPTION)
        inputs = preflight(cfg)  # rows, model folder, index: read and checked before torch, the model or DeepSpeed
        from training.loop.trainer import SSPTrainer  # lazy: torch, numpy (and DeepSpeed, vLLM when it builds the engines)

        trainer = SSPTrainer(cfg, inputs)  # validates again once the world size is known, then the run folder
    except InputError as e:
        sys.exit(f"train.py: {e}")
    trainer.run()


if __name__ == "__main__":
    main()
