"""One default per setting (issue 31 §2): a setting that train.py's flags, the inference dataclasses and eval.py's
flags all have takes one default, the inference dataclass field's (inference/ never imports training/).

They had drifted: --rag_distractors 2 against GameConfig's 4, --pool_size 256 against 1024, --max_info_tokens 384
against the rollout's and eval's 512, --solver_n 4 against GameConfig.solver_n 5. Every pair is found by
introspection (same-named fields, plus the renamed ones listed here), so a new shared field is checked too.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from inference.engine_api import MAX_MODEL_LEN
from inference.evaluate import EvalConfig
from inference.game import GameConfig
from inference.rollout import RolloutConfig
from training.settings.config import GROUPS, build_parser

DATACLASSES = (GameConfig, RolloutConfig)
RENAMED = {  # train.py flag -> (dataclass, field) it feeds (one name since issue 34; the game once renamed them)
    "proposer_n": (GameConfig, "proposer_n"), "solver_n": (GameConfig, "solver_n"),
    "rag_verify": (GameConfig, "rag_verify"), "format_penalty": (GameConfig, "format_penalty"),
    "use_pool": (GameConfig, "use_pool"),
}
NOT_SHARED = {  # same name, another meaning
    "seed": "train.py's --seed is the run's global seed; the trainer derives GameConfig.seed and RolloutConfig.seed "
            "per rank and step from it",
}
# eval.py flag (dest) -> train.py flag, for the settings eval shares with train.py beyond its run protocol
EVAL_TRAIN = {"engine": "rollout_engine", "tp": "vllm_tp", "kv_cache_mb": "kv_cache_mb"}
EVAL_OWN = {  # eval.py's run-protocol settings whose default differs from train.py's on purpose
    "dtype": "eval defaults to float32 (bf16 greedy differs from fp32); in a run folder it takes the run's dtype",
}


def defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def parser_defaults(p) -> dict:
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def train_vs_dataclasses(train: dict, classes=DATACLASSES, renamed=RENAMED) -> tuple[set, list]:
    """(the shared settings, the ones whose defaults differ as (flag, flag's default, source, its default))."""
    pairs = {name: (cls, name) for cls in classes for name in defaults(cls) if name in train and name not in NOT_SHARED}
    pairs.update(renamed)
    bad = [(flag, train[flag], f"{cls.__name__}.{name}", defaults(cls)[name]) for flag, (cls, name) in pairs.items()
           if train[flag] != defaults(cls)[name]]
    return set(pairs), bad


def test_train_flags_take_their_defaults_from_the_inference_dataclasses():
    train = parser_defaults(build_parser())
    shared, bad = train_vs_dataclasses(train)
    assert bad == [], bad
    # the pairs were found at all: the settings issue 31 settled, and the rest of the game's and rollout's
    assert {"rag_distractors", "pool_size", "max_info_tokens", "solver_n", "min_searches", "proposer_reward", "rag_verify",
            "format_penalty", "use_pool", "pool_min_solve_rate", "pool_max_solve_rate", "pool_clear_every", "template",
            "max_turns", "max_tokens_per_turn", "max_total_tokens", "topk", "temperature", "top_p"} <= shared, shared
    assert (train["rag_distractors"], train["pool_size"], train["max_info_tokens"], train["solver_n"]) == (2, 256, 512, 5)
    assert train["max_model_len"] == MAX_MODEL_LEN
    # the fields of the Config dataclasses are the flags: the parser adds nothing and drops nothing
    assert set(train) == {f.name for cls in GROUPS.values() for f in fields(cls)}


def test_the_comparison_sees_a_drift():
    """A control: a dataclass whose default differs from the flag's is reported, under either name."""
    @dataclass
    class Drifted:
        rag_distractors: int = 4
        samples: int = 4

    _, bad = train_vs_dataclasses({"rag_distractors": 2, "solver_n": 5}, (Drifted,), {"solver_n": (Drifted, "samples")})
    assert sorted(bad) == [("rag_distractors", 2, "Drifted.rag_distractors", 4), ("solver_n", 5, "Drifted.samples", 4)]


def test_eval_flags_take_their_defaults_from_the_rollout_and_agree_with_train():
    import eval as eval_cli

    ev, train = parser_defaults(eval_cli.build_parser()), parser_defaults(build_parser())
    rollout = {k: v for k, v in defaults(RolloutConfig).items() if k in ev and k not in ("temperature", "seed")}
    assert set(rollout) == {"topk", "max_turns", "max_tokens_per_turn", "max_total_tokens", "max_info_tokens", "self_search",
                            "max_inflight"}
    assert {k: ev[k] for k in rollout} == rollout
    assert ev["rollout_schedule"] == train["rollout_schedule"] == RolloutConfig.schedule == "trajectory"
    assert (ev["template"], ev["samples"], ev["batch_size"]) == (EvalConfig.template, EvalConfig.samples,
                                                                 EvalConfig.batch_size)
    assert ev["temperature"] == EvalConfig().rollout.temperature == 0.0       # eval is greedy, unlike training
    assert ev["max_model_len"] == MAX_MODEL_LEN
    # every run-protocol setting eval can take from a run's config.json starts from train.py's default
    same = {dest: (group, name) for dest, (group, name) in eval_cli.RUN_PROTOCOL.items() if dest not in EVAL_OWN}
    assert {"max_info_tokens", "max_model_len", "template", "topk"} <= set(same)
    bad = {dest: (ev[dest], train[name]) for dest, (_, name) in same.items() if ev[dest] != train[name]}
    bad.update({dest: (ev[dest], train[t]) for dest, t in EVAL_TRAIN.items() if ev[dest] != train[t]})
    assert bad == {}, bad
    assert set(EVAL_OWN) <= set(eval_cli.RUN_PROTOCOL)


def test_sft_reads_the_rollouts_information_budget():
    """SFT renders demonstrations with the rollout's own <information> cut: its default must be the rollout's."""
    import inspect

    from training.loop.sft import SFT_GROUPS, parse_sft_args, render_demo

    # its flag is train.py's own --max_info_tokens (training/flags.derive_group), default and all
    assert SFT_GROUPS["rollout"]().max_info_tokens == RolloutConfig.max_info_tokens == 512
    cfg, _ = parse_sft_args(["--data", __file__, "--max_info_tokens", "160"])
    assert cfg.rollout.max_info_tokens == 160
    assert inspect.signature(render_demo).parameters["max_info_tokens"].default == RolloutConfig.max_info_tokens
