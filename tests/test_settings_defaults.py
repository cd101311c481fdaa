"""One default per setting: train.py's flags, eval.py's flags and the runtime dataclasses they feed agree.

Issue 34, point 2: a setting was declared up to four times (the flags, GameConfig, RolloutConfig, eval.py)
with different names and defaults. eval.py now builds its rollout flags from train.py's dataclass fields
(training.settings.config.add_field_flags); this test fails when any default drifts again.

One name per setting too: the game's fields carry their flags' names (proposer_n, solver_n, use_pool,
format_penalty, rag_verify were once proposer_samples, solver_samples, pool_fill, invalid_penalty, rag_verifier).
The mapping is read from training/engine/setup.py's GameConfig(...)/RolloutConfig(...) calls (ast), so it has no
second copy here; a field fed from a flag of another name is refused unless RENAMES_KEPT says why.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Flags both parsers have whose eval default differs on purpose, each with why. Any other shared flag
# must have one default.
EVAL_OWN_DEFAULTS = {
    "--temperature": "eval is greedy (EvalConfig), so a number does not depend on a sampling seed",
    "--seed": "eval's engine seed, used only with --temperature > 0; not the training seed",
    "--dtype": "eval takes torch's spellings too and defaults to fp32 outside a run (a run supplies its own)",
    "--report_to": "an eval logs to no tracker unless asked",
    "--eval_limit": "None = every row; train's 64 bounds the in-training eval's cost",
    # None = not given: taken from the run's config.json when --model is in a run, else no search / no judge
    "--solver_search": "None = the run's backend, else no search tool",
    "--index": "None = the run's backend, else no search tool",
    "--retriever_url": "None = the run's backend, else no search tool",
    "--sim_url": "None = the run's, else the evaluated model in-process",
    "--sim_model": "None = the run's, else the server's first model",
    "--judge_url": "None = exact match only",
    "--judge_model": "None = the server's first model",
    "--eval_data": "None = only --data",
}


def _options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def _parsers():
    import eval as eval_cli
    from training.settings.config import build_parser

    return _options(build_parser()), _options(eval_cli.build_parser())


def shared_flag_mismatches(train: dict, ev: dict) -> list[str]:
    return [f"{o}: train.py {train[o].default!r}, eval.py {ev[o].default!r}"
            for o in sorted(set(train) & set(ev))
            if o not in EVAL_OWN_DEFAULTS and train[o].default != ev[o].default]


def _feeds(path: Path, cls_name: str) -> list[tuple[str, str]]:
    """(dataclass field, train flag) for every `cls_name(field=<x>.<flag>, ...)` keyword in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == cls_name:
            out += [(k.arg, k.value.attr) for k in node.keywords if isinstance(k.value, ast.Attribute)]
    return out


def field_flag_mismatches(train: dict) -> list[str]:
    from inference.game import GameConfig
    from inference.rollout import RolloutConfig

    bad = []
    for cls in (GameConfig, RolloutConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        feeds = _feeds(REPO / "training/engine/setup.py", cls.__name__)
        assert feeds, f"no {cls.__name__}(...) call read in training/engine/setup.py: the test lost its mapping"
        for fname, flag in feeds:
            if f"--{flag}" in train and defaults.get(fname, dataclasses.MISSING) is not dataclasses.MISSING:
                if defaults[fname] != train[f"--{flag}"].default:
                    bad.append(f"{cls.__name__}.{fname} = {defaults[fname]!r}, but --{flag} (which feeds it) "
                               f"defaults to {train[f'--{flag}'].default!r}")
    return bad


def test_flags_in_both_parsers_have_one_default():
    train, ev = _parsers()
    assert len(set(train) & set(ev)) >= 20  # the rollout protocol, search backend, data and judge flags
    assert not shared_flag_mismatches(train, ev)
    assert set(EVAL_OWN_DEFAULTS) <= set(train) & set(ev), "a listed exception is no longer a shared flag"


def test_eval_rollout_flags_are_train_flags():
    """Same help and choices too: they are declared once, in training/settings/config.py."""
    train, ev = _parsers()
    for o in ("--topk", "--max_turns", "--max_tokens_per_turn", "--max_total_tokens", "--max_info_tokens",
              "--max_model_len", "--kv_cache_mb", "--vllm_tp", "--rollout_engine"):
        assert (ev[o].default, ev[o].help, ev[o].choices, ev[o].type) == \
               (train[o].default, train[o].help, train[o].choices, train[o].type), o


def test_runtime_dataclass_defaults_equal_the_flags_that_feed_them():
    train, _ = _parsers()
    fed = {f for cls in ("GameConfig", "RolloutConfig") for f, _ in _feeds(REPO / "training/engine/setup.py", cls)}
    # the renames are covered, read from the trainer's calls
    assert {"proposer_n", "use_pool", "format_penalty", "rag_verify", "max_turns"} <= fed
    assert not field_flag_mismatches(train)


# dataclass field -> why it keeps a name other than its flag's
RENAMES_KEPT = {
    "schedule": "RolloutConfig.schedule is the rollout's own word; the flag says which schedule (--rollout_schedule)",
}


def test_each_runtime_field_has_its_flags_name():
    renamed = [f"{cls}.{f} <- --{flag}" for cls in ("GameConfig", "RolloutConfig")
               for f, flag in _feeds(REPO / "training/engine/setup.py", cls) if f != flag and f not in RENAMES_KEPT]
    assert not renamed, f"a setting with two names (name the field as its flag, or say why in RENAMES_KEPT): {renamed}"


def test_a_changed_default_is_caught(monkeypatch):
    """The checks above are not vacuous: one default moved on either side is reported."""
    from inference.game import GameConfig

    train, ev = _parsers()
    monkeypatch.setattr(ev["--max_turns"], "default", train["--max_turns"].default + 1)
    assert shared_flag_mismatches(train, ev) == [
        f"--max_turns: train.py {train['--max_turns'].default!r}, eval.py {ev['--max_turns'].default!r}"]
    fields = {f.name: f for f in dataclasses.fields(GameConfig)}
    monkeypatch.setattr(fields["format_penalty"], "default", -123.0)
    assert any(m.startswith("GameConfig.format_penalty = -123.0") for m in field_flag_mismatches(train))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
