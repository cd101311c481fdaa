"""Issue 40, defect 3: abort_all must empty vLLM itself, a refused prefix-cache reset must raise, and the RAG check
must refuse verifier replies that do not pair one to one with its candidates (the round's check: the policy's outputs
are paired with its prompts by the engine's stepper, the judge's replies with its chats by the pipeline).

abort_all used to pass LLM.enqueue's ids (vLLM's internal ids) to abort_request as external ids: vLLM found none and
aborted none, the next generate() returned the leftovers as well, and the prefix-cache reset after a weight sync
then failed silently (KV of the old weights reused)."""

from __future__ import annotations

import pytest

from inference.data import ProposerRow
from inference.engine_api import SamplingConfig, per_prompt_sampling
from inference.game import GameConfig, play_round
from inference.judge import Judge
from inference.rollout import RolloutConfig
from tests.scripted_policy import LINCOLN, ScriptedPolicy, is_rag_check

LONG = SamplingConfig(temperature=0.0, max_tokens=256, min_tokens=256)   # min_tokens bans EOS: none ends early


def _vllm_unfinished(engine) -> int:
    """vLLM's own count, not the wrapper's."""
    return engine.llm.llm_engine.get_num_unfinished_requests()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_abort_all_empties_vllm_and_the_prefix_cache_resets(vllm_engine):
    tok = vllm_engine.tokenizer
    prompts = [tok(f"Count to one hundred, number {i}:", add_special_tokens=False)["input_ids"] for i in range(4)]
    for i, p in enumerate(prompts):
        vllm_engine.submit(("k", i), p, LONG)
    for _ in range(3):
        assert vllm_engine.step() == []
    assert _vllm_unfinished(vllm_engine) == 4 and vllm_engine.num_unfinished() == 4
    with pytest.raises(RuntimeError, match="prefix cache"):   # real vLLM refuses while requests hold KV blocks
        vllm_engine.reset_prefix_cache()

    vllm_engine.abort_all()
    assert _vllm_unfinished(vllm_engine) == 0, "abort_all left requests running inside vLLM"
    assert vllm_engine.num_unfinished() == 0 and not vllm_engine.llm.llm_engine.has_unfinished_requests()
    vllm_engine.reset_prefix_cache()            # raises if vLLM refused (blocks still held)
    outs = vllm_engine.generate([prompts[0]], SamplingConfig(temperature=0.0, max_tokens=4))
    assert len(outs) == 1, f"generate() of one prompt returned {len(outs)} outputs (aborted requests came back)"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_refused_prefix_cache_reset_raises(vllm_engine, monkeypatch):
    monkeypatch.setattr(vllm_engine.llm, "reset_prefix_cache", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="prefix cache"):
        vllm_engine.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="prefix cache"):
        vllm_engine.update_weights([])          # a sync's reset goes through the same check


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_refuses_to_hand_back_leftover_requests(vllm_engine):
    tok = vllm_engine.tokenizer
    p = tok("Name a river:", add_special_tokens=False)["input_ids"]
    vllm_engine.submit("left", p, SamplingConfig(temperature=0.0, max_tokens=4))
    with pytest.raises(RuntimeError, match="2 outputs for 1 prompts"):   # LLM.generate collected the leftover too
        vllm_engine.generate([p], SamplingConfig(temperature=0.0, max_tokens=4))
    vllm_engine.abort_all()                     # clears the wrapper's record of it; vLLM has finished it
    assert vllm_engine.num_unfinished() == 0 and len(vllm_engine.generate([p], SamplingConfig(max_tokens=4))) == 1


# ---- the RAG check pairs each reply with its candidate: counts must agree (no vLLM needed) -----------------------

ROWS = [ProposerRow(LINCOLN, 2), ProposerRow("Algeria", 2)]   # two Lincoln candidates; Algeria's are filtered out
RCFG = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=64, topk=2)


class WrongCountReader(ScriptedPolicy):
    """The scripted policy, returning `extra` more (or fewer) outputs for a batch that holds a RAG-check prompt."""

    def __init__(self, tok, extra: int):
        super().__init__(tok)
        self.extra = extra

    def generate(self, prompts, sampling):
        outs = super().generate(prompts, sampling)
        if any(is_rag_check(s) for s in per_prompt_sampling(sampling, len(prompts))):
            outs = outs[:len(outs) + self.extra] if self.extra < 0 else outs + outs[:1] * self.extra
        return outs


class WrongCountJudge(Judge):
    def __init__(self, extra: int):
        super().__init__("http://127.0.0.1:9", model="m")   # never called: the solvers' answers match exactly
        self.extra = extra

    def chat_many(self, messages, max_tokens=64, temperature=0.0):
        return ["<answer> Lincoln </answer>"] * (len(messages) + self.extra)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("extra", [1, -1])
def test_rag_check_policy_refuses_a_reply_count_that_differs(tok, bm25, extra):
    cfg = GameConfig(proposer_n=2, solver_n=1, rag_verify="policy", rag_distractors=1, rag_max_tokens=16)
    with pytest.raises(RuntimeError, match="outputs for"):
        play_round(WrongCountReader(tok, extra), ROWS, bm25.search, Judge(), cfg, RCFG)
    # the right count still passes
    res = play_round(WrongCountReader(tok, 0), ROWS, bm25.search, Judge(), cfg, RCFG)
    assert [t.outcome.rag for t in res.trajectories if t.role == "proposer"] == [True, True, None, None]


@pytest.mark.parametrize("extra", [1, -1])
def test_rag_check_judge_refuses_a_reply_count_that_differs(tok, bm25, extra):
    cfg = GameConfig(proposer_n=2, solver_n=1, rag_verify="judge", rag_distractors=1, rag_max_tokens=16)
    with pytest.raises(RuntimeError, match="replies for 2 RAG prompts"):
        play_round(ScriptedPolicy(tok), ROWS, bm25.search, WrongCountJudge(extra), cfg, RCFG)
    res = play_round(ScriptedPolicy(tok), ROWS, bm25.search, WrongCountJudge(0), cfg, RCFG)
    assert [t.outcome.rag for t in res.trajectories if t.role == "proposer"] == [True, True, None, None]


class _BrokenJudge(Judge):
    """Exact match, failing as a bug would on its first grading, while other solvers are still decoding."""

    def judge_many(self, items):
        raise RuntimeError("judge bug")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_error_mid_round_leaves_vllm_itself_empty(vllm_engine, bm25):
    """Issue 40 (7): the pipeline's error test ran on GenerateStepper, where nothing is in flight when the error is
    raised; here real vLLM requests are: the round's error must leave vLLM's own count at 0, and the next sync's
    prefix-cache reset must succeed."""
    rows = [ProposerRow("Paris", 1)]
    qa = [{"question": f"What is the capital of country number {k}?", "answer": "x"} for k in range(3)]
    cfg = GameConfig(proposer_n=2, solver_n=4, rag_verify="off", min_searches=1, seed=1)
    # different caps per role: the QA solvers end at once (4 tokens) while the proposers still decode
    rcfg = {"proposer": RolloutConfig(max_turns=2, max_tokens_per_turn=200, topk=1, seed=2),
            "solver": RolloutConfig(max_turns=1, max_tokens_per_turn=4, topk=1, seed=2)}
    with pytest.raises(RuntimeError, match="judge bug"):
        play_round(vllm_engine, rows, bm25.search, _BrokenJudge(), cfg, rcfg, qa_questions=qa)
    assert _vllm_unfinished(vllm_engine) == 0
    vllm_engine.reset_prefix_cache()
