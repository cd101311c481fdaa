"""Training configuration: the settings groups gathered into one Config, its flags, and what "auto" resolves to.

Every field of a group becomes `--<field>` with its `help` text; the groups organise `--help` and the run's
config.json. The groups are declared in training/settings/settings_play.py (model, rollout, search, self-play) and
training/settings/settings_learn.py (algorithm, distillation, critic, optimisation, DeepSpeed, logging, checkpoints,
eval), each with a `check()` of its own fields; training/settings/flags.py turns fields into flags; training/settings/validation.py's
`validate_args` joins the groups' checks with those across groups and refuses bad combinations, saying *why*.
This module re-exports their public names, so `from training.settings.config import ...` is the one place to ask.

A setting the inference side also has (the game's GameConfig, the rollout's RolloutConfig) takes its
default from that dataclass field, its one source: eval.py reads the same fields, and
tests/training/test_shared_defaults.py fails when a default is written twice and drifts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from inference.game import resolve_proposer_reward
# re-exported: the names callers have always imported from here
from training.settings.critic_config import needs_critic  # noqa: F401
from training.settings.flags import F, add_field_flags, groups_from_namespace, parse_bool, parser_for  # noqa: F401
from training.settings.settings_learn import (ESTIMATORS, AlgoArgs, CkptArgs, CriticArgs, DeepSpeedArgs,  # noqa: F401
                                     DistillArgs, EvalArgs, LogArgs, OptimArgs)
from training.settings.settings_play import (AUTO_PROMPTS_PER_GROUP, SEARCH_BACKENDS, ModelArgs, RolloutArgs,  # noqa: F401
                                    SearchArgs, SelfPlayArgs)
from training.settings.validation import ConfigError, needs_reference, validate_args  # noqa: F401

__all__ = [  # this module's own names, and those re-exported from the modules above
    "GROUPS", "MOVED_FIELDS", "Config", "build_parser", "config_from_flags", "parse_config", "resolve_defaults", "upgrade_saved_config",
    "needs_critic", "F", "add_field_flags", "groups_from_namespace", "parse_bool", "parser_for",
    "ESTIMATORS", "AlgoArgs", "CkptArgs", "CriticArgs", "DeepSpeedArgs", "DistillArgs", "EvalArgs", "LogArgs", "OptimArgs",
    "AUTO_PROMPTS_PER_GROUP", "SEARCH_BACKENDS", "ModelArgs", "RolloutArgs", "SearchArgs", "SelfPlayArgs",
    "ConfigError", "needs_reference", "validate_args",
]

GROUPS = {
    "model": ModelArgs, "rollout": RolloutArgs, "search": SearchArgs, "selfplay": SelfPlayArgs,
    "algorithm": AlgoArgs, "distill": DistillArgs, "critic": CriticArgs, "optimisation": OptimArgs,
    "deepspeed": DeepSpeedArgs, "logging": LogArgs, "checkpointing": CkptArgs, "eval": EvalArgs,
}


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    search: SearchArgs = field(default_factory=SearchArgs)
    selfplay: SelfPlayArgs = field(default_factory=SelfPlayArgs)
    algorithm: AlgoArgs = field(default_factory=AlgoArgs)
    distill: DistillArgs = field(default_factory=DistillArgs)
    critic: CriticArgs = field(default_factory=CriticArgs)
    optimisation: OptimArgs = field(default_factory=OptimArgs)
    deepspeed: DeepSpeedArgs = field(default_factory=DeepSpeedArgs)
    logging: LogArgs = field(default_factory=LogArgs)
    checkpointing: CkptArgs = field(default_factory=CkptArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


# config.json written before a field moved to another group: {old group: (new group, the fields that moved)}
MOVED_FIELDS = {
    "algorithm": ("distill", tuple(f.name for f in fields(DistillArgs))),  # issue 34: --distill* got its own group
}


def upgrade_saved_config(saved: dict) -> dict:
    """A saved config.json (Config.to_dict()) in today's layout: fields written under the group they used to
    belong to (MOVED_FIELDS) move to their group now, so an old run folder compares and resumes as it ran.
    Returns a copy; a dict already in today's layout comes back equal."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for old, (new, names) in MOVED_FIELDS.items():
        if isinstance(out.get(old), dict):
            moved = {n: out[old].pop(n) for n in names if n in out[old]}
            if moved:
                out[new] = {**moved, **(out[new] if isinstance(out.get(new), dict) else {})}
    return out


def build_parser(description: str = "", groups: dict | None = None):
    """One flag per field of the given dataclass groups (default: every group of Config)."""
    return parser_for(groups or GROUPS, description)


def config_from_flags(argv: list[str] | None = None, description: str = "", world_size: int | None = None) -> Config:
    """train.py's flags made into a Config with its "auto" defaults resolved, and no check of paths or values."""
    ns = build_parser(description).parse_args(argv)
    return resolve_defaults(Config(**groups_from_namespace(GROUPS, ns)), world_size=world_size)


def parse_config(argv: list[str] | None = None, description: str = "") -> Config:
    cfg = config_from_flags(argv, description)
    validate_args(cfg)
    return cfg


def resolve_defaults(cfg: Config, world_size: int | None = None) -> Config:
    """Turn "auto" choices into what they stand for, so config.json records what actually ran.
    --prompts_per_step 0 (auto) needs the world size; without one it stays 0."""
    sp = cfg.selfplay
    sp.proposer_reward = resolve_proposer_reward(sp.proposer_reward, sp.rag_verify)
    if sp.prompts_per_step == 0 and world_size:
        sp.prompts_per_step = AUTO_PROMPTS_PER_GROUP * max(1, world_size // max(1, cfg.rollout.vllm_tp))
    return cfg
