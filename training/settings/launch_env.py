"""What the launch environment says about a run: the CPU demo's defaults that a CUDA or multi-node run must
replace (validate_args refuses them unless --allow_demo_defaults true), whether CUDA is present, and how many
nodes the launcher started. Kept apart from training/settings/validation.py, whose
validate_args calls these checks (so this module takes a training.settings.config.Config but imports none); imports no torch."""

from __future__ import annotations

import glob
import os
import sys


DEMO_DEFAULTS = (
    ("model", "model_path", "the CPU demo's 135M model",
     "--model_path with your policy's HF folder or hub id (e.g. Qwen/Qwen2.5-7B-Instruct)"),
    ("search", "index", "the CPU demo's BM25 index of data/corpus, since --retriever_url is empty",
     "--retriever_url with your retrieval server (scripts/start_retriever.sh, one per node), or --index with "
     "your own index folder"),
    ("selfplay", "train_data", "the CPU demo's pool of 2000 answers",
     "--train_data with your proposer rows (answer + search_turns)"),
)


def demo_defaults_in_use(cfg) -> list[str]:
    """One line per demo default this config would run with ("still the default" = equal to the
    dataclass default), each naming the flag that replaces it. Only defaults that are used count:
    the index only while a role searches with the retriever and no --retriever_url is set, the
    answer pool only with self-play on."""
    s, sp = cfg.search, cfg.selfplay
    used = {"model_path": True,
            "index": "retriever" in (s.proposer_search, s.solver_search) and not s.retriever_url,
            "train_data": sp.self_play_enable}
    out = []
    for group, name, what, fix in DEMO_DEFAULTS:
        value = getattr(getattr(cfg, group), name)
        # the group's dataclass (training.settings.config.GROUPS[group]) declares the default
        if used[name] and value == type(getattr(cfg, group)).__dataclass_fields__[name].default:
            out.append(f"--{name} {value} ({what}): pass {fix}")
    return out


def cuda_present() -> bool:
    """Whether this machine has a CUDA GPU: torch's answer when torch is already imported, else
    whether an NVIDIA device node exists (so parsing and the dry run stay light)."""
    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def node_count(env=None) -> int:
    """Nodes of this launch, from the launcher's environment: CROSS_SIZE (deepspeed launcher),
    GROUP_WORLD_SIZE (torchrun), else WORLD_SIZE over the local world size (LOCAL_WORLD_SIZE of
    torchrun, LOCAL_SIZE of deepspeed); 1 when nothing says otherwise."""
    env = os.environ if env is None else env

    def num(key):
        try:
            return int(env[key])
        except (KeyError, ValueError):
            return None
    nodes = [n for n in (num("CROSS_SIZE"), num("GROUP_WORLD_SIZE")) if n]
    world, local = num("WORLD_SIZE"), num("LOCAL_WORLD_SIZE") or num("LOCAL_SIZE")
    if world and local:
        nodes.append(-(-world // local))
    return max(nodes, default=1)


def demo_default_errors(cfg, cuda: bool, multi_node: bool) -> list[str]:
    """The refusal of the CPU demo's defaults on CUDA or across nodes (one message naming each
    default in use and its flag), unless --allow_demo_defaults true; [] on CPU on one node."""
    if not (cuda or multi_node) or cfg.selfplay.allow_demo_defaults:
        return []
    used = demo_defaults_in_use(cfg)
    if not used:
        return []
    where = " and ".join(w for w, on in (("on CUDA", cuda), ("across nodes", multi_node)) if on)
    return [f"this run is {where}, but would train with the CPU demo's defaults, which a real run replaces:\n      "
            + "\n      ".join(used)
            + "\n    or pass --allow_demo_defaults true to run with them on purpose"]
