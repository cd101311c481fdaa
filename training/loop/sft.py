"""Supervised cold start (SFT) on multi-turn search demonstrations, before self-play RL.

    python -m training.loop.sft --data data/train/coldstart.jsonl --output_dir runs/sft --dtype fp32
    torchrun --nproc_per_node 2 -m training.loop.sft ...   # or: deepspeed --hostfile hostfile --module training.loop.sft ...

Same parts as RL (DeepSpeed-Chat's step 1 before its step 3): the engine builder
(ZeRO-3 actor, torch AdamW), the packed one-row micro-batches with per-sequence
attention, the chunked log-prob head. The loss is the mean negative log-likelihood of
the tokens the assistant writes; the prompt and the <information> blocks carry none,
by the rollout loop's own mask rule: each demonstration is rendered into exactly the
token sequence a rollout would build (`render_demo`), with the retrieved documents
cut to --max_info_tokens like a rollout cuts them.

Demonstrations come from `python -m dataprep.coldstart` (one JSON per line):
  {"role": "solver"|"proposer", "question" | "answer" (+ "n_searches"),
   "turns": [{"kind": "model", "text": "... </search>"}, {"kind": "info", "docs": [...]}, ...]}

Checkpoints (--save_every) resume exactly with --resume auto; the end of the run writes
an HF folder at <output_dir>/hf that train.py (--model_path) and eval.py (--model) start from.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):   # `python training/loop/sft.py`: the repo is not importable
    sys.exit("training/loop/sft.py is a module of the repo: run it from the repo's root as `python -m training.loop.sft ...` "
             "(torchrun ... -m training.loop.sft, deepspeed ... --module training.loop.sft)")

from utils.dist import prepare_launch_env  # noqa: E402

prepare_launch_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from inference.data import read_records  # noqa: E402  (these light: no torch)
from inference.prompts import build_proposer_prompt, build_solver_prompt, format_docs  # noqa: E402
from inference.rollout import RolloutConfig, info_block_tokens  # noqa: E402
from inference.trajectory import Trajectory  # noqa: E402
from training.settings.config import (GROUPS, F, CkptArgs, Config, ConfigError, DeepSpeedArgs, LogArgs, ModelArgs,  # noqa: E402
                             OptimArgs, RolloutArgs, build_parser, groups_from_namespace)
from training.settings.flags import derive_group  # noqa: E402
from training.engine.guards import NonFiniteGuard  # noqa: E402
from training.settings.input_checks import model_path_errors, report_to_errors  # noqa: E402
from training.algorithm.lr_schedule import set_lr  # noqa: E402
from training.engine.run_state import find_resume  # noqa: E402
from utils import dist as D  # noqa: E402
from utils.logging import RunLogger, fmt_metrics  # noqa: E402


@dataclass
class SFTArgs:
    data: str = F("data/train/coldstart.jsonl", "demonstrations (JSONL) from `python -m dataprep.coldstart`")
    epochs: int = F(1, "passes over the demonstrations")
    batch_size: int = F(32, "demonstrations per optimizer step, global across ranks (a multiple of the world size)")
    max_demos: int = F(0, "use only the first N demonstrations after the seeded shuffle (0 = all)")
    roles: str = F("proposer,solver", "comma-separated roles whose demonstrations are trained on")


# train.py's declarations, with the SFT's own defaults (training/flags.derive_group): no flag is declared twice
SFT_GROUPS = {
    "model": ModelArgs,
    "optimisation": derive_group(OptimArgs, "SFTOptimArgs", lr=2e-5, lr_schedule="cosine", warmup_steps=2,
                                 micro_token_budget=4096),
    "deepspeed": DeepSpeedArgs,
    "logging": derive_group(LogArgs, "SFTLogArgs", output_dir="runs/sft", sample_every=0),
    "checkpointing": derive_group(CkptArgs, "SFTCkptArgs", keep=("save_every", "resume"), save_every=0),
    # the documents cut as train.py's rollouts cut them (keep it equal to train.py's, so demos look like rollouts)
    "rollout": derive_group(RolloutArgs, "SFTRolloutArgs", keep=("max_info_tokens",)),
    "sft": SFTArgs,
}
PARTIAL = ("checkpointing", "rollout")   # groups of which sft.py takes a few flags: set onto train.py's whole group


def parse_sft_args(argv: list[str] | None = None) -> tuple[Config, SFTArgs]:
    ns = build_parser(__doc__.split("\n")[0], groups=SFT_GROUPS).parse_args(argv)
    parts = groups_from_namespace(SFT_GROUPS, ns)
    sft = parts.pop("sft")
    for name in PARTIAL:
        parts[name] = replace(GROUPS[name](), **vars(parts[name]))
    cfg = Config(**parts)
    validate_sft(cfg, sft)
    return cfg, sft


def validate_sft(cfg: Config, sft: SFTArgs, world_size: int | None = None) -> None:
    errs = []
    if not Path(sft.data).exists():
        errs.append(f"--data {sft.data} does not exist; build it with `python -m dataprep.coldstart`")
    errs += model_path_errors(cfg.model.model_path)
    if sft.epochs < 1 or sft.batch_size < 1:
        errs.append(f"--epochs and --batch_size must be >= 1 (got {sft.epochs}, {sft.batch_size})")
    bad = [r for r in sft.roles.split(",") if r.strip() not in ("proposer", "solver")]
    if bad or not sft.roles.strip():
        errs.append(f"--roles {sft.roles!r}: give proposer, solver or both, comma-separated")
    if cfg.model.train_top_layers < 0:
        errs.append(f"--train_top_layers must be >= 0 (got {cfg.model.train_top_layers})")
    errs += report_to_errors(cfg.logging.report_to)
    if world_size is not None and sft.batch_size % world_size:
        errs.append(f"--batch_size {sft.batch_size} must be a multiple of the world size {world_size} "
                    f"(every rank packs the same number of demonstrations per step)")
    if errs:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))


# ----------------------------------------------------------------------------- rendering

def render_demo(tokenizer, demo: dict, template: str = "auto", max_info_tokens: int = RolloutConfig.max_info_tokens):
    """Token ids and loss mask of one demonstration, built exactly as a rollout builds them:
    the role's prompt (mask 0), each model turn's tokens (mask 1), each information block
    through the rollout loop's own `info_block_tokens` (mask 0, documents cut to max_info_tokens)."""
    role = demo.get("role")
    if role == "solver":
        ids = build_solver_prompt(tokenizer, demo["question"], template)
    elif role == "proposer":
        ids = build_proposer_prompt(tokenizer, demo["answer"], int(demo.get("n_searches", 1)), template)
    else:
        raise ValueError(f"demonstration role must be 'solver' or 'proposer', got {role!r}")
    ids = list(ids)
    mask = [0] * len(ids)
    turns = demo.get("turns") or []
    if not any(t.get("kind") == "model" for t in turns):
        raise ValueError("demonstration has no model turn: nothing to learn from it")
    for t in turns:
        if t.get("kind") == "model":
            toks = tokenizer(t["text"], add_special_tokens=False)["input_ids"]
            mask += [1] * len(toks)
        elif t.get("kind") == "info":
            toks = info_block_tokens(tokenizer, format_docs(t.get("docs")), max_info_tokens)
            mask += [0] * len(toks)
        else:
            raise ValueError(f"turn kind must be 'model' or 'info', got {t.get('kind')!r}")
        ids += list(toks)
    return ids, mask


def load_demos(path: str | Path, roles: set[str], seed: int, limit: int = 0) -> list[dict]:
    demos = [d for d in read_records(path) if d.get("role") in roles]
    if not demos:
        raise ValueError(f"{path} holds no demonstrations of role(s) {sorted(roles)}")
    order = np.random.default_rng(seed).permutation(len(demos))
    demos = [demos[i] for i in order]
    return demos[:limit] if limit else demos


def demos_to_trajectories(tokenizer, demos: list[dict], template: str, max_info_tokens: int):
    out = []
    for k, d in enumerate(demos):
        ids, mask = render_demo(tokenizer, d, template, max_info_tokens)
        out.append(Trajectory(role=d["role"], group_id=f"sft-{k}", token_ids=ids, loss_mask=mask,
                              logprobs=[0.0] * len(ids)))
    return out


# ----------------------------------------------------------------------------- the loss

def sft_loss(logprobs: torch.Tensor, micro_batch) -> torch.Tensor:
    """Summed negative log-likelihood of the masked (model-written) tokens of one packed micro-batch."""
    mask = micro_batch.tensors["loss_mask"].to(logprobs.device, logprobs.dtype)
    return -(logprobs * mask).sum()


# ----------------------------------------------------------------------------- the loop

class SFTTrainer:
    def __init__(self, cfg: Config, sft: SFTArgs):
        D.init_distributed()
        validate_sft(cfg, sft, world_size=D.world_size())
        self.cfg, self.sft, self.D = cfg, sft, D
        self.out = Path(cfg.logging.output_dir)
        if D.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "sft_config.json").write_text(json.dumps({**cfg.to_dict(), "sft": sft.__dict__}, indent=2) + "\n")
        D.barrier()
        torch.manual_seed(cfg.optimisation.seed)
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.model_path)
        roles = {r.strip() for r in sft.roles.split(",") if r.strip()}
        demos = load_demos(sft.data, roles, cfg.optimisation.seed, sft.max_demos)
        self.trajs = demos_to_trajectories(self.tokenizer, demos, cfg.model.template, cfg.rollout.max_info_tokens)
        longest = max(len(t.token_ids) for t in self.trajs)
        if longest > cfg.optimisation.micro_token_budget:
            raise ConfigError(f"the longest demonstration has {longest} tokens, more than --micro_token_budget "
                              f"{cfg.optimisation.micro_token_budget}; raise the budget or lower --max_info_tokens")
        self.steps_per_epoch = max(1, len(self.trajs) // sft.batch_size)
        self.total = self.steps_per_epoch * sft.epochs
        # the LR schedule runs over the whole SFT run
        cfg.optimisation.total_steps = self.total
        from training.engine.engine_builder import build_engines
        self.engines = build_engines(cfg)
        self.actor = self.engines.actor
        self.log = RunLogger(self.out, tensorboard=cfg.logging.tensorboard, report_to=cfg.logging.report_to,
                             config={**cfg.to_dict(), "sft": dict(sft.__dict__)}, job_type="sft")
        self.step = 0
        self.nonfinite = NonFiniteGuard(cfg.optimisation.max_nonfinite_steps)
        self._resume()

    def _resume(self) -> None:
        from training.engine import checkpoint as C
        path = find_resume(self.out, self.cfg.checkpointing.resume)
        if path is not None:
            self.step = int(C.load(self.actor, path)["step"])
            self.D.barrier()
            if self.D.is_main():
                print(f"sft: resumed from {path} at step {self.step}", flush=True)

    def batch(self, step: int) -> list:
        """This rank's share of step `step`: a fixed permutation per epoch, so the step alone restores it."""
        epoch, k = divmod(step, self.steps_per_epoch)
        n, b = len(self.trajs), self.sft.batch_size
        order = np.random.default_rng(self.cfg.optimisation.seed + 1 + epoch).permutation(n)
        idx = order[k * b:(k + 1) * b]
        return [self.trajs[i] for i in idx[self.D.rank()::self.D.world_size()]]

    def train_step(self, step: int) -> dict:
        from training.algorithm.micro_batches import accumulate, pack_equal
        from training.algorithm.update import optimizer_step

        D = self.D
        t0 = time.perf_counter()
        mbs, _ = pack_equal(self.batch(step), self.cfg.optimisation.micro_token_budget)
        local = sum(int(mb.tensors["loss_mask"].sum().item()) for mb in mbs)
        n_tok = D.all_reduce_sum([float(local)])[0]
        set_lr(self.actor, self.cfg, step)
        self.actor.train()

        def loss_fn(mb, lp, _ent):  # global token mean: ranks with more tokens weigh more
            loss = sft_loss(lp, mb) / max(n_tok, 1.0)
            return loss, {"loss": loss.detach()}

        metrics = accumulate(self.actor, mbs, loss_fn)
        stepped = optimizer_step(self.actor, "actor")
        gn = self.actor.get_global_grad_norm()
        total = sum(float(m["loss"]) for m in metrics)
        return {"sft/loss": D.all_reduce_sum([total])[0], "sft/tokens": n_tok,
                "actor/skipped_steps": float(not stepped), "actor/grad_norm": float(gn) if gn is not None else 0.0,
                "actor/lr": float(self.actor.get_lr()[0]), "timing_s/step": time.perf_counter() - t0}

    def save(self) -> None:
        from training.engine import checkpoint as C
        C.save(self.actor, self.out, self.step, {}, tokenizer_dir=self.cfg.model.model_path, export=False,
               max_ckpts=2)

    def run(self) -> Path:
        from tqdm import tqdm

        from training.engine.hf_export import export_hf

        D = self.D
        bar = tqdm(total=self.total, initial=self.step, desc="sft", unit="step", disable=not D.is_main())
        while self.step < self.total:
            m = self.train_step(self.step)
            self.step += 1
            m["sft/epoch"] = self.step / self.steps_per_epoch
            self.log.scalars(self.step, m)
            self.nonfinite.update_skipped(m)   # the same on every rank; raises after --max_nonfinite_steps in a row
            bar.update(1)
            bar.set_postfix_str(fmt_metrics(m, ["sft/loss", "actor/grad_norm", "timing_s/step"]))
            every = self.cfg.checkpointing.save_every
            if every and self.step % every == 0 and self.step < self.total:
                self.save()
        bar.close()
        hf = self.out / "hf"
        export_hf(self.actor.module, self.cfg.model.model_path, hf)
        self.log.close()
        if D.is_main():
            print(f"sft: {self.total} steps done; HF export at {hf}", flush=True)
        return hf


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, sft = parse_sft_args(argv)
        trainer = SFTTrainer(cfg, sft)
    except (ConfigError, ValueError) as e:
        sys.exit(f"sft.py: {e}")
    trainer.run()


if __name__ == "__main__":
    main()
