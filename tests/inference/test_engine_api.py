"""The rollout-engine protocol (inference/engine_api.py): both engines implement it, its members are what the
callers really use, and a real HFEngine on the tiny model keeps its contract. VLLMEngine's classes are
checked here without starting vLLM; tests/inference/test_engines.py checks a running one."""

from __future__ import annotations

import ast
import inspect
import math
import subprocess
from pathlib import Path

from typing import Protocol

import pytest
import torch

from inference.engine_api import (WAKE_TAGS, GenerateStepper, GenOutput, RolloutEngine, SamplingConfig, SteppedGenerator,
                                  TokenGenerator, cut_at_stop)
from inference.engines import VLLMEngine
from inference.hf_engine import HFEngine

ROOT = Path(__file__).resolve().parents[2]
ENGINES = [HFEngine, VLLMEngine]


def protocol_members(proto: type) -> tuple[set[str], set[str]]:
    """(methods, data attributes) a Protocol declares, its bases' included; read from the classes themselves."""
    methods, data = set(), set()
    for cls in proto.__mro__:
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        methods |= {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}
        data |= {n for n in vars(cls).get("__annotations__", {}) if not n.startswith("_")}
    return methods, data


def test_the_protocols_declare_what_the_brief_names():
    methods, data = protocol_members(RolloutEngine)
    assert methods == {"generate", "update_weights", "load_weights", "expect_weights", "reset_prefix_cache",
                       "sleep", "wake_up"}
    assert data == {"tokenizer", "max_model_len"}
    assert protocol_members(TokenGenerator) == ({"generate"}, {"tokenizer", "max_model_len"})


@pytest.mark.parametrize("engine", ENGINES, ids=lambda c: c.__name__)
def test_each_engine_implements_every_method_with_the_protocols_signature(engine):
    methods, _ = protocol_members(RolloutEngine)
    for name in sorted(methods):
        want = inspect.signature(getattr(RolloutEngine, name))
        impl = getattr(engine, name, None)
        assert callable(impl), f"{engine.__name__} has no {name}()"
        assert impl is not getattr(RolloutEngine, name), f"{engine.__name__}.{name} is the protocol's stub"
        got = inspect.signature(impl)
        # Same parameters, in order, of the same kind and default: a caller written against the protocol
        # (positional or keyword) works on either engine. Annotations are compared as written.
        assert [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()] == \
               [(p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()], (engine.__name__, name)
        assert got.return_annotation == want.return_annotation, (engine.__name__, name)


@pytest.mark.parametrize("engine", [*ENGINES, GenerateStepper], ids=lambda c: c.__name__)
def test_each_engine_is_stepped_with_the_protocols_signature(engine):
    """The trajectory schedule's submit/step (inference/rollout.py) on vLLM, HF and the generate()-only adapter."""
    methods, data = protocol_members(SteppedGenerator)
    assert methods - protocol_members(TokenGenerator)[0] == {"submit", "step", "num_unfinished", "abort_all",
                                                             "share_from_first"}
    for name in ("lockstep_ranks", "lockstep_first"):
        assert name in data and hasattr(engine, name), (engine.__name__, name)
    for name in sorted(methods - {"generate"}):
        want, impl = inspect.signature(getattr(SteppedGenerator, name)), getattr(engine, name, None)
        assert callable(impl) and impl is not getattr(SteppedGenerator, name), (engine.__name__, name)
        got = inspect.signature(impl)
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in want.parameters.values()], (engine.__name__, name)


def test_the_adapter_batches_what_was_submitted_since_the_last_step():
    """GenerateStepper over a generate()-only engine: one generate() per step, keys back in order, then empty."""
    class Echo:
        tokenizer, max_model_len, calls = None, 64, []

        def generate(self, prompts, sampling):
            self.calls.append(len(prompts))
            return [GenOutput(list(p[-1:]), [0.0], "", "eos", None) for p in prompts]

    s = GenerateStepper(Echo())
    s.submit("a", [1, 2], SamplingConfig(max_tokens=1))
    s.submit("b", [3], SamplingConfig(max_tokens=1))
    assert s.num_unfinished() == 2
    assert [(k, o.token_ids) for k, o in s.step()] == [("a", [2]), ("b", [3])]
    assert s.num_unfinished() == 0 and s.step() == [] and Echo.calls == [2]
    s.submit("c", [4], SamplingConfig(max_tokens=1))
    s.abort_all()
    assert s.num_unfinished() == 0 and s.step() == [] and Echo.calls == [2]


def test_a_class_missing_a_method_is_not_a_rollout_engine():
    """The check above, and isinstance, would catch an engine that drops a member."""
    class NoSleep:
        tokenizer, max_model_len = None, 8

        def generate(self, prompts, sampling):
            return []

        update_weights = load_weights = expect_weights = generate

        def reset_prefix_cache(self):
            pass

        def wake_up(self, tags=None):
            pass

    assert isinstance(NoSleep(), TokenGenerator) and not isinstance(NoSleep(), RolloutEngine)


# ----------------------------------------------------------------------------- what the callers use

def attributes_used(path: str, receivers: set[str]) -> set[str]:
    """Attribute names read on the given receivers (`engine`, `self.llm`, ...) in one file, getattr(x, "name") too."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in receivers:
            used.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) >= 2 \
                and ast.unparse(node.args[0]) in receivers and isinstance(node.args[1], ast.Constant):
            used.add(node.args[1].value)
    return used


CALLERS = [  # (file, receivers bound to an engine there, the protocol they are typed with)
    ("training/engine/hybrid.py", {"self.llm"}, RolloutEngine),
    ("inference/rollout.py", {"engine"}, SteppedGenerator),
    ("inference/step_loop.py", {"engine", "self.engine"}, SteppedGenerator),
    ("inference/pipeline.py", {"engine", "self.engine"}, TokenGenerator),
    # inference/game.py only hands the engine on to the pipeline (it touched it for the staged round, gone in issue 43)
    ("inference/evaluate.py", {"engine"}, TokenGenerator),
    # inference/rag_check.py builds the verifier's prompt; the pipeline hands it to the engine (issue 43)
    ("inference/simulated_search.py", {"engine", "self.engine"}, TokenGenerator),
]


@pytest.mark.parametrize("path, receivers, proto", CALLERS, ids=[c[0] for c in CALLERS])
def test_callers_use_only_what_the_protocol_declares(path, receivers, proto):
    methods, data = protocol_members(proto)
    used = attributes_used(path, receivers)
    assert used, f"{path}: no use of {receivers} found (the scan or the list is stale)"
    assert used <= methods | data, f"{path} uses {sorted(used - methods - data)} outside {proto.__name__}"


def test_the_hybrid_engine_uses_the_whole_sync_and_memory_protocol():
    methods, _ = protocol_members(RolloutEngine)
    assert attributes_used("training/engine/hybrid.py", {"self.llm"}) == methods - {"generate", "update_weights"}


def test_only_the_engine_modules_import_vllm():
    """The style guide: every vLLM call in one place. That place is now inference/engines.py and the two modules
    it wraps around vLLM; nothing else outside tests imports it."""
    files = subprocess.run(["git", "ls-files", "--", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    importers = set()
    for f in files:
        if f.startswith("tests/") or not (ROOT / f).is_file():
            continue
        for node in ast.walk(ast.parse((ROOT / f).read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "vllm" for n in names):
                importers.add(f)
    assert "inference/engines.py" in importers, importers  # the scan sees an import at all
    assert importers <= {"inference/engines.py", "inference/vllm_compat.py", "inference/vllm_inproc.py"}, importers


# ----------------------------------------------------------------------------- a real HFEngine

@pytest.fixture
def hf(tiny_model_dir):
    return HFEngine(tiny_model_dir, batch_size=2)


@pytest.fixture
def prompts(hf):
    tok = hf.tokenizer
    return [tok("The quick brown fox", add_special_tokens=False)["input_ids"],
            tok("1 2 3 4 5 6", add_special_tokens=False)["input_ids"],
            tok("Which river flows through Vienna?", add_special_tokens=False)["input_ids"]]


def test_a_real_hf_engine_is_a_rollout_engine(hf):
    assert isinstance(hf, RolloutEngine) and isinstance(hf, TokenGenerator)
    assert hf.max_model_len == 4096 and hf.tokenizer is not None


def test_generate_returns_gen_outputs_whose_ids_decode_to_their_text(hf, prompts):
    tok = hf.tokenizer
    for s in (SamplingConfig(temperature=0.0, max_tokens=12), SamplingConfig(temperature=1.0, max_tokens=12, seed=3)):
        outs = hf.generate(prompts, s)
        assert len(outs) == len(prompts)  # three prompts over two chunks of batch_size 2
        for o in outs:
            assert isinstance(o, GenOutput)
            assert len(o.token_ids) == len(o.logprobs) and 1 <= len(o.token_ids) <= 12
            assert all(isinstance(t, int) for t in o.token_ids) and all(lp <= 0 for lp in o.logprobs)
            assert o.finish_reason in ("eos", "length") and o.stop_str is None
            assert (o.finish_reason == "length") == (len(o.token_ids) == 12 and o.token_ids[-1] not in hf.eos_ids)
            assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert hf.generate([], SamplingConfig()) == []


def test_a_stop_string_cuts_the_text_but_keeps_the_sampled_tokens(hf, prompts):
    """A stop string taken from the greedy reply itself: the same greedy run ends there, the text is cut right
    after it, and the ids are the reply's first tokens, the last one kept whole."""
    tok = hf.tokenizer
    full = hf.generate(prompts[:1], SamplingConfig(temperature=0.0, max_tokens=16))[0]
    assert full.finish_reason == "length"  # a random model: EOS is one token of ~49k
    text = tok.decode(full.token_ids, skip_special_tokens=True)
    windows = (tok.decode(full.token_ids[i:i + 2], skip_special_tokens=True).strip() for i in range(3, 14))
    stop = next(w for w in windows if w and "\ufffd" not in w and w in text)  # whole characters only
    o = hf.generate(prompts[:1], SamplingConfig(temperature=0.0, max_tokens=16, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.stop_str == stop
    assert o.token_ids == full.token_ids[:len(o.token_ids)] and o.logprobs == full.logprobs[:len(o.logprobs)]
    decoded = tok.decode(o.token_ids, skip_special_tokens=True)
    assert o.text.endswith(stop) and decoded.startswith(o.text)
    assert (o.text, stop) == cut_at_stop(decoded, [stop]) and o.text == text[:text.index(stop) + len(stop)]


def test_hf_sleep_is_a_state_generate_respects(hf, prompts):
    s = SamplingConfig(temperature=0.0, max_tokens=4, min_tokens=4)
    before = hf.generate(prompts[:1], s)
    with pytest.raises(ValueError, match="level"):
        hf.sleep(level=3)
    hf.sleep(level=2)
    hf.sleep(level=1)  # asleep already: a no-op
    with pytest.raises(RuntimeError, match="asleep"):
        hf.generate(prompts[:1], s)
    hf.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="kv_cache"):  # the hybrid engine syncs here, before the KV cache
        hf.generate(prompts[:1], s)
    hf.load_weights([("model.norm.weight", hf.model.model.norm.weight.detach().clone())])  # syncing while half awake
    with pytest.raises(ValueError, match="tags"):
        hf.wake_up(["optimizer"])
    hf.wake_up(["kv_cache"])
    assert hf.generate(prompts[:1], s) == before  # level 2 discards nothing here: the same weights answer
    hf.wake_up()  # awake already: a no-op
    assert not hf.asleep
    hf.sleep(level=1)
    hf.wake_up()  # None wakes every tag
    assert not hf.asleep and WAKE_TAGS == ("weights", "kv_cache")


def test_hf_weight_sync_really_changes_what_it_samples(hf, prompts):
    """A zero final norm makes every hidden state 0, so (tied lm_head, no bias) every logit is 0 and each sampled
    token's raw log-prob is -log(vocab): an independent number, not a comparison with our own earlier run."""
    names = [n for n, _ in hf.model.named_parameters()]
    hf.expect_weights(names)
    with pytest.raises(KeyError, match="lm_head.bias"):
        hf.expect_weights(names + ["lm_head.bias"])
    with pytest.raises(KeyError, match="lm_head.bias"):
        hf.load_weights([("lm_head.bias", torch.zeros(1))])
    norm = hf.model.model.norm.weight
    vocab = hf.model.get_output_embeddings().weight.shape[0]
    hf.update_weights([("model.norm.weight", torch.zeros_like(norm))])
    o = hf.generate(prompts[:1], SamplingConfig(temperature=1.0, max_tokens=5, min_tokens=5, seed=0))[0]
    assert o.logprobs == pytest.approx([-math.log(vocab)] * 5, abs=1e-5)
    assert torch.count_nonzero(norm) == 0  # copied in place into the model's own parameter
