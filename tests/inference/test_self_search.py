"""Self-search (SSRL): the loss mask of self-written <information> blocks, token by token, through the
real rollout loop (inference/rollout.py, self_search=True); the self-search prompt; the format reward.

The mask is checked against an independent reference built from each token's raw bytes (byte-level
BPE), not from the incremental decoding the rollout uses: a sampled token has mask 0 exactly when
its bytes overlap a model-written <information>...</information> block (tags included; an unclosed
block runs to the end of the turn), and mask 1 otherwise.
"""

from __future__ import annotations

import re

import pytest
import torch

from inference.engine_api import GenOutput, SamplingConfig, cut_at_stop
from inference.prompts import TEMPLATES
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts
from inference.self_search import (
    SELF_SEARCH_INSTRUCTION, build_self_search_prompt, format_reward, shaped_reward,
)

pytestmark = pytest.mark.timeout(300)


# --- the byte-level reference --------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable-char table, which SmolLM2's byte-level BPE uses for its vocab.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


def token_bytes(tok, t: int) -> bytes:
    piece = tok.convert_ids_to_tokens(int(t))
    if t in tok.all_special_ids:
        return piece.encode("utf-8")
    return bytes(_BYTE_OF[c] for c in piece)


def reference_mask(tok, gen: list[int]) -> list[int]:
    """Mask of sampled tokens from byte ranges: 0 iff the token's bytes overlap an information block."""
    raw = [token_bytes(tok, t) for t in gen]
    text = b"".join(raw).decode("utf-8")
    blocks = [(len(text[: m.start()].encode()), len(text[: m.end()].encode()))
              for m in re.finditer(r"<information>.*?(?:</information>|$)", text, re.DOTALL)]
    out, pos = [], 0
    for r in raw:
        a, b = pos, pos + len(r)
        out.append(0 if any(a < e and b > s for s, e in blocks) else 1)
        pos = b
    return out


# --- a replaying engine for hand-made turns --------------------------------------------------------

class ReplayEngine:
    """Test-only engine for bookkeeping: replays given token ids under the real engines' stop rules.

    Stop string -> the token that completed it is kept (and nothing after); EOS; max_tokens. Each
    token's log-prob is the real teacher-forced log-prob of the tiny model, so logprob bookkeeping
    is checked on real numbers.
    """

    def __init__(self, model, tokenizer, turns: list[list[int]]):
        self.model, self.tokenizer, self.turns = model, tokenizer, list(turns)
        self.max_model_len = 4096
        self.samplings: list[SamplingConfig] = []

    def generate(self, prompts, sampling):
        sampling = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        outs = []
        for p, s in zip(prompts, sampling):
            self.samplings.append(s)
            ids, reason, hit = [], "length", None
            for t in self.turns.pop(0)[: s.max_tokens]:
                ids.append(t)
                if t == self.tokenizer.eos_token_id:
                    reason = "eos"
                    break
                _, hit = cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), s.stop)
                if hit:
                    reason = "stop"
                    break
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([list(p) + ids]), use_cache=False).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            lps = [float(lp[len(p) - 1 + k, t]) for k, t in enumerate(ids)]
            outs.append(GenOutput(ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True), reason, hit))
        return outs


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# Hand-made self-search turns, each a different way the block edges can fall on tokens.
TURNS = {
    "two_blocks_merged_edges": (
        "<think>I need two facts.</think><search>capital of France</search><information>Paris is the capital "
        "of France.</information><search>river of Paris</search><information>The Seine flows through Paris."
        "</information><think>So Paris.</think><answer>Paris</answer>", "answer"),
    "newline_edges_and_unicode": (
        "<think>Recall it.</think>\n<search> Beyoncé birthplace </search>\n\n<information>\nDoc 1 (Title: "
        "Beyoncé) Beyoncé was born in Houston, Texas 🙂.\n</information>\n\n🙂 <answer> Houston </answer>", "answer"),
    "tag_words_outside_blocks": (
        "<think>No information needed; information is everywhere.</think><answer>42</answer>", "answer"),
    "empty_block": ("<search>x</search><information></information><answer>y</answer>", "answer"),
    "eos_after_answer_text": ("<search>q</search><information>text</information> done", "eos"),
}


@pytest.mark.parametrize("name", list(TURNS))
def test_self_written_information_is_masked_token_by_token(tiny, name):
    model, tok = tiny
    text, expect_stop = TURNS[name]
    prompt = build_self_search_prompt(tok, "Where?")
    gen = _enc(tok, text) + ([tok.eos_token_id] if expect_stop == "eos" else [])
    eng = ReplayEngine(model, tok, [gen + _enc(tok, " never sampled")])
    cfg = RolloutConfig(self_search=True, max_tokens_per_turn=512, seed=0)
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", prompt)], None, cfg)

    assert eng.samplings[0].stop == ["</answer>"]  # no stop at </search>: the model writes the results itself
    assert t.stop_reason == expect_stop and t.num_turns == 1
    assert t.token_ids == prompt + gen  # the sampled ids verbatim, nothing inserted by the environment
    assert t.loss_mask[: len(prompt)] == [0] * len(prompt)
    sampled_mask = t.loss_mask[len(prompt):]
    assert sampled_mask == reference_mask(tok, gen)
    # log-probs: the engine's for trained tokens, 0 for masked ones
    engine_lps = [lp for lp in _replayed_logprobs(model, prompt, gen)]
    assert t.logprobs[len(prompt):] == pytest.approx([lp if m else 0.0 for lp, m in zip(engine_lps, sampled_mask)])
    # every character of a block is covered by masked tokens, and the trained tokens hold none of a block
    masked_text = tok.decode([x for x, m in zip(gen, sampled_mask) if m == 0])
    kept_text = tok.decode([x for x, m in zip(gen, sampled_mask) if m == 1])
    for block in re.findall(r"<information>.*?</information>", text, re.DOTALL):
        assert block in masked_text
    assert "<information>" not in kept_text and "</information>" not in kept_text
    n_blocks = text.count("<information>")
    assert (0 in sampled_mask) == (n_blocks > 0)
    assert len(t.docs) == n_blocks and t.num_searches == text.count("<search>")


def _replayed_logprobs(model, prompt, gen):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen]), use_cache=False).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(gen)]


def test_unclosed_block_cut_by_the_token_budget_is_masked_to_the_end(tiny):
    model, tok = tiny
    prompt = build_self_search_prompt(tok, "Where?")
    head = _enc(tok, "<think>hm</think><search>q</search><information>The answer is")
    gen = head + _enc(tok, " somewhere far away") * 20
    eng = ReplayEngine(model, tok, [gen])
    cfg = RolloutConfig(self_search=True, max_tokens_per_turn=len(head) + 10)
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", prompt)], None, cfg)
    sampled = t.token_ids[len(prompt):]
    assert t.stop_reason == "max_tokens" and len(sampled) == len(head) + 10
    assert t.loss_mask[len(prompt):] == reference_mask(tok, sampled)
    first_masked = t.loss_mask.index(0, len(prompt))
    assert tok.decode(t.token_ids[first_masked:]).startswith("><information>") or \
        tok.decode(t.token_ids[first_masked:]).startswith("<information>")
    assert t.loss_mask[first_masked:] == [0] * (len(t.token_ids) - first_masked)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_self_search_mask(smollm2_dir):
    """SmolLM2-135M (HFEngine), few-shot prompted to write its own results: whatever it samples, the
    mask follows the reference; the seeded run must write at least one block for the check to bite."""
    from inference.hf_engine import HFEngine

    eng = HFEngine(smollm2_dir, batch_size=4)
    tok = eng.tokenizer
    few_shot = (
        "Question: What is the capital of Italy?\n<search> capital of Italy </search>\n<information> Rome is the "
        "capital city of Italy. </information>\n<answer> Rome </answer>\n\n"
        "Question: Who discovered penicillin?\n<search> penicillin discovery </search>\n<information> Penicillin "
        "was discovered by Alexander Fleming in 1928. </information>\n<answer> Alexander Fleming </answer>\n\n"
    )
    qs = ["What is the capital of France?", "Who wrote Hamlet?", "Who painted the Mona Lisa?",
          "Which river flows through Vienna?"]
    reqs = [RolloutRequest("solver", f"g{i}", _enc(tok, few_shot + f"Question: {q}\n"), question=q)
            for i, q in enumerate(qs)]
    cfg = RolloutConfig(self_search=True, max_tokens_per_turn=48, seed=3, temperature=0.7)
    trs = run_rollouts(eng, reqs, None, cfg)
    blocks = 0
    for r, t in zip(reqs, trs):
        gen = t.token_ids[len(r.prompt_ids):]
        assert t.loss_mask[len(r.prompt_ids):] == reference_mask(tok, gen), tok.decode(gen)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
        kept = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m == 1]
        assert all(lp <= 0.0 for lp in kept) and sum(kept) < 0  # real log-probs, not placeholders
        blocks += len(t.docs)
    assert blocks >= 2, [t.response_text for t in trs]


# --- the prompt ------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", TEMPLATES)
def test_self_search_prompt(tiny, template):
    _, tok = tiny
    ids = build_self_search_prompt(tok, "  Who wrote Hamlet?  ", template=template)
    text = tok.decode(ids)
    assert SELF_SEARCH_INSTRUCTION in text
    assert text.endswith(("Assistant:", "<|im_start|>assistant\n", "assistant<|end_header_id|>\n\n"))  # the model's turn
    assert "Question: Who wrote Hamlet?" in text and "<information>" in text
    with pytest.raises(ValueError, match="question is empty"):
        build_self_search_prompt(tok, "  ", template=template)
    with pytest.raises(ValueError, match="unknown template"):
        build_self_search_prompt(tok, "q", template="nope")


# --- the format reward -----------------------------------------------------------------------------

GOOD = [
    "<think>I know this.</think><answer>Paris</answer>",
    "<think>Look it up.</think>\n<search> capital of France </search>\n<information> Paris is the capital. "
    "</information>\n<think>So Paris.</think>\n<answer> Paris </answer>",
    "  \n<think>a < b and x<3 are not tags</think><answer>b</answer>\n<|im_end|>",
    "<think>t</think><answer>x</answer><|im_end|>\n<|endoftext|>",
]
BAD = {
    "no_think_first": "<search>q</search><information>d</information><answer>x</answer>",
    "text_before_think": "Sure! <think>t</think><answer>x</answer>",
    "no_answer": "<think>t</think><search>q</search><information>d</information>",
    "text_after_answer": "<think>t</think><answer>x</answer> and more",
    "unknown_tag": "<think>t</think><result>d</result><answer>x</answer>",
    "unknown_tag_inside": "<think>see <b>this</b></think><answer>x</answer>",
    "unclosed_search": "<think>t</think><search>q<information>d</information><answer>x</answer>",
    "stray_close": "<think>t</think></search><answer>x</answer>",
    "nested": "<think>t <search>q</search></think><answer>x</answer>",
    "mismatched": "<think>t</search><answer>x</answer>",
    "empty_answer": "<think>t</think><answer>  </answer>",
    "empty_think": "<think></think><answer>x</answer>",
    "empty_information": "<think>t</think><search>q</search><information>\n</information><answer>x</answer>",
    "double_open": "<think>t</think><answer><answer>x</answer>",
    "empty": "",
    "not_a_string": None,
}


@pytest.mark.parametrize("text", GOOD)
def test_format_reward_good(text):
    assert format_reward(text) == 1.0


@pytest.mark.parametrize("name", list(BAD))
def test_format_reward_bad(name):
    assert format_reward(BAD[name]) == 0.0


def test_shaped_reward():
    assert shaped_reward(1, 1.0) == pytest.approx(1.0)
    assert shaped_reward(True, 0.0) == pytest.approx(0.9)
    assert shaped_reward(0, 1.0) == pytest.approx(0.1)
    assert shaped_reward(0.0, 0) == 0.0


def test_default_spam_divisor_is_the_games():
    """shape_solver_rewards' default divisor is rewards.SPAM_DIVISOR (self_search cannot import the game, which
    imports it); the game's own default must be the same number, so a run's shaping keeps its spam penalty."""
    import inspect

    from inference.game import GameConfig
    from inference.rewards import SPAM_DIVISOR, solver_reward
    from inference.self_search import shape_solver_rewards

    assert GameConfig.spam_divisor == SPAM_DIVISOR == 4.0
    assert inspect.signature(shape_solver_rewards).parameters["spam_divisor"].default == SPAM_DIVISOR
    assert inspect.signature(solver_reward).parameters["spam_divisor"].default == SPAM_DIVISOR
