"""What a round shows (issue 31 §1): informative solver groups, fresh questions' solve rates, why a proposer
wrote no question, what kind the valid questions are, and what the pool served. Each count is checked
against a hand count of hand-made trajectories; the shares against the same counts divided by hand."""

from __future__ import annotations

import pytest

from inference.data import ProposerRow
from inference.engine_api import GenOutput
from inference.game import (COUNT_KEYS, GameConfig, answer_in_text, is_count, no_question_why, one_search_answerable,
                            shares, signal_counts)
from inference.game_metrics import answer_kind, round_stats
from inference.pipeline import filter_reason
from inference.rollout import RolloutConfig, RolloutRequest, run_rollouts
from inference.trajectory import GameMeta, Outcome, Trajectory

Q = "Which city on the river Seine hosted the Summer Olympic Games in the year 1900?"


def page(title: str, text: str) -> dict:
    return {"id": title, "contents": f"{title}\n{text}", "score": 1.0}


def prop(question="", answer="Paris", docs=(), queries=("Paris city", "Olympics 1900"), row=0, stop="question", cap=""):
    return Trajectory("proposer", f"s0-p{row}", [1, 2], [0, 1], [0.0, -1.0], question=question, answer=answer,
                      stop_reason=stop, num_searches=len(queries),
                      queries=list(queries), docs=[list(c) for c in docs], cap=cap,
                      meta=GameMeta(search_turns=2, row=row))


def sol(gid: str, correct: bool, source="proposer", proposer=0, reward=None):
    t = Trajectory("solver", gid, [1, 2], [0, 1], [0.0, -0.5], question=Q, answer="Paris",
                   reward=float(correct) if reward is None else reward,
                   outcome=Outcome(correct=correct, spam=False, judge_failed=False),
                   meta=GameMeta(proposer=proposer if source == "proposer" else None, source=source))
    return t


def test_why_no_question_names_each_way_a_proposer_stops():
    cases = [("question", Q, "", None), ("question", "  ", "", "empty"), ("max_tokens", "", "turn", "turn_cap"),
             ("max_tokens", "", "total", "total_cap"), ("max_turns", "", "", "out_of_turns"), ("eos", "", "", "eos"),
             ("no_action", "", "", "no_action")]
    for stop, q, cap, want in cases:
        assert no_question_why(prop(q, stop=stop, cap=cap)) == want, (stop, cap)


class _Babbler:
    """Writes `n` tokens of plain text a turn and never an action, so every turn ends at a token cap."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len = tokenizer, 4096
        self.word = tokenizer(" hello", add_special_tokens=False)["input_ids"]

    def generate(self, prompts, sampling):
        out = []
        for s in sampling:
            ids = (self.word * s.max_tokens)[: s.max_tokens]
            out.append(GenOutput(ids, [-1.0] * len(ids), self.tokenizer.decode(ids), "length"))
        return out


def test_the_rollout_says_which_cap_cut_a_turn(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tok("You set puzzles.", add_special_tokens=False)["input_ids"]
    req = RolloutRequest("proposer", "g", prompt, answer="Paris")
    # the turn's own cap: 8 of 8 tokens used, far from the total budget
    (t,) = run_rollouts(_Babbler(tok), [req], None, RolloutConfig(max_turns=2, max_tokens_per_turn=8))
    assert (t.stop_reason, t.cap, no_question_why(t)) == ("max_tokens", "turn", "turn_cap")
    # the total budget: room for 3 tokens though a turn may take 8
    cfg = RolloutConfig(max_turns=2, max_tokens_per_turn=8, max_total_tokens=len(prompt) + 3)
    (t,) = run_rollouts(_Babbler(tok), [req], None, cfg)
    assert (t.stop_reason, t.cap, no_question_why(t)) == ("max_tokens", "total", "total_cap")
    assert t.num_sampled == 3


def test_informative_groups_are_the_ones_whose_rewards_differ():
    sols = ([sol("q0", c) for c in (1, 0, 0)]                    # fresh, mixed: informative
            + [sol("q1", 0) for _ in range(3)]                    # fresh, all wrong: flat
            + [sol("q2", 1) for _ in range(3)]                    # fresh, all right: flat
            + [sol("q3", c, source="pool") for c in (0, 1)]       # pool, mixed
            + [sol("q4", 1, source="qa"), sol("q4", 1, source="qa", reward=0.25)])  # qa: spam divides one reward
    got = signal_counts(sols)
    assert (got["game/solver_groups"], got["game/informative_groups"]) == (5, 3)
    assert [(got[f"game/solver_groups/{s}"], got[f"game/informative_groups/{s}"]) for s in ("fresh", "pool", "qa")] \
        == [(3, 1), (1, 1), (1, 1)]
    sols[0].outcome.excluded = "judge_failed"                    # a group left out of the loss carries nothing
    assert signal_counts(sols)["game/informative_groups/fresh"] == 0


def test_stats_count_solve_rates_kinds_stops_and_the_pool():
    docs = [[page("Paris", "Capital of France."), page("Lyon", "A city.")],
            [page("1900 Summer Olympics", "The games were held in Paris.")]]
    props = [prop(Q, "Paris", docs, row=0),                                        # valid; in text (the Olympics page)
             prop(Q.replace("city", "town"), "Paris", docs[:1], row=1),           # valid; title only
             prop("", stop="max_tokens", cap="turn", row=2), prop("", stop="max_turns", row=3)]
    reasons = [filter_reason(t, GameConfig(rag_verify="off")) for t in props]   # the round's cheap filters
    assert reasons == [None, None, "no_question", "no_question"]
    verdict = {0: True, 1: True}   # --rag_verify off passes every filtered question
    sols = ([sol("q0", c, proposer=0) for c in (1, 0)] + [sol("q1", 0, proposer=1) for _ in range(2)]
            + [sol("q2", 1, source="pool"), sol("q2", 1, source="pool"), sol("q3", 0, source="pool"),
               sol("q3", 0, source="pool")])
    served = ["What is X?", "what is x", "What is Y?"]                             # one repeat after normalising
    st = round_stats(props, sols, reasons, verdict, 3, None, served, [True, False])
    assert (st["game/fresh_s0"], st["game/fresh_mid"], st["game/fresh_s1"]) == (1, 1, 0)
    assert (st["game/no_question"], st["game/no_question/turn_cap"], st["game/no_question/out_of_turns"]) == (2, 1, 1)
    assert (st["game/valid_answer_in_text"], st["game/valid_probed"], st["game/valid_one_search"]) == (1, 2, 1)
    assert (st["game/pool_repeats"], st["game/pool_served_trajs"], st["game/pool_served_correct"]) == (1, 4, 2.0)
    assert answer_in_text(props[0]) and not answer_in_text(props[1])

    sh = shares(st)
    assert sh["game/informative_share"] == pytest.approx(1 / 4)                   # q0 only
    assert sh["game/fresh_s0_share"] == pytest.approx(0.5) and sh["game/fresh_s1_share"] == 0
    assert sh["game/no_question_share"] == pytest.approx(2 / 4)
    assert sh["game/valid_one_search_share"] == pytest.approx(1 / 2)
    assert sh["game/pool_served_acc"] == pytest.approx(2 / 4)
    assert sh["solver/acc_fresh"] == pytest.approx(1 / 4)
    assert "game/informative_share/qa" not in sh                                   # no qa group: no value, not 0

    # every count is summed over ranks, every mean averaged (the trainer's reduction reads is_count)
    means = {"game/valid_rate", "game/filter_pass_rate", "game/rag_pass_rate", "game/pool_size",
             "proposer/reward_mean",
             "proposer/searches_mean", "solver/acc", "solver/reward_mean", "solver/spam_rate", "solver/turns_mean",
             "solver/searches_mean"}
    assert {k for k in st if not is_count(k)} == means
    assert all(is_count(k) for k in COUNT_KEYS) and is_count("game/filter/no_question")


def test_the_kind_probe_searches_each_question_once(bm25):
    qs = ["Which river flows through Paris?", "Which river flows through Paris?"]
    doc1 = bm25.search(qs[:1], 3)[0][0]["contents"].partition("\n")[0]           # Doc 1's title: in what it returns
    calls = []
    search = lambda q, k: calls.append(list(q)) or bm25.search(q, k)             # noqa: E731
    assert one_search_answerable(qs, [doc1, "Zqxwv Plorkmund"], search, 3) == [True, False]
    assert calls == [qs]                                                           # one batched call
    assert one_search_answerable(qs, ["a", "b"], None, 3) is None

    class Simulated:
        wants_context = True

        def __call__(self, *a, **k):
            raise AssertionError("a simulated backend writes its documents: it is never probed")
    assert one_search_answerable(qs, ["a", "b"], Simulated(), 3) is None


def test_a_rollout_record_is_json_and_says_why(tmp_path):
    import json

    from inference.game import rollout_record
    from utils.logging import write_jsonl_atomic

    docs = [[page("Paris", "Capital of France.")], [page("1900 Summer Olympics", "Held in Paris.")]]
    p = prop("", "Paris", docs, stop="max_tokens", cap="turn")
    p.outcome.filter_reason, p.outcome.valid = "no_question", False
    s = sol("s0-q0", True)
    s.outcome.pred, s.outcome.excluded = "Paris", None
    write_jsonl_atomic(tmp_path / "r.jsonl", [rollout_record(p), rollout_record(s)])
    a, b = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert (a["role"], a["no_question"], a["cap"], a["filter_reason"]) == ("proposer", "turn_cap", "turn", "no_question")
    assert a["titles"] == [["Paris"], ["1900 Summer Olympics"]] and a["queries"] == ["Paris city", "Olympics 1900"]
    assert (b["role"], b["source"], b["correct"], b["pred"], b["reward"], b["no_question"]) == \
        ("solver", "proposer", True, "Paris", 1.0, None)


# Issue 41 §2, the game per slot: 4 proposer slots (slot i is proposer trajectory i's, inference/pipeline.py).
# Slot 0: its own valid question, informative; slot 1: invalid, a pool replay, informative; slots 2, 3: invalid and
# the pool had nothing left, so no solver group at all. A fixed QA question takes a slot of its own after them.
HAND_ROWS = [ProposerRow("Paris", 2, "wiki", {"title": "Paris", "doc_id": "1"}),           # name: title = answer
             ProposerRow(["Eiffel Tower", "Tour Eiffel"], 2, "wiki", {"title": "Tour Eiffel"}),  # name, by an alias
             ProposerRow("1889", 2, "fact"),                                                  # fact: its data_source
             ProposerRow("Seine", 2, "wiki", {"title": "Paris"})]                            # neither: other
HAND_REASONS = [None, "too_short", "no_question", "rag_failed"]


def hand_round(served: int = 3) -> dict:
    """The round above; `served`: how many times its one pool question has been served so far."""
    props = [prop(Q, "Paris", row=0), prop("Short?", row=1), prop("", stop="max_turns", row=2), prop(Q, row=3)]
    sols = ([sol("s0-q0", c, proposer=0) for c in (1, 0)] + [sol("s0-q1", c, source="pool") for c in (0, 1)]
            + [sol("s0-q4", 1, source="qa") for _ in range(2)])
    return round_stats(props, sols, HAND_REASONS, {0: True, 3: False}, 1, None, ["What is X?"], rows=HAND_ROWS,
                       served_counts=[served])


def test_the_game_per_slot_counts_the_empty_slots_and_reads_fresh_signal_per_slot():
    st = hand_round()
    assert (st["game/solver_slots"], st["game/empty_slots"]) == (4, 2)            # the QA slot is not a proposer slot
    assert st["game/solver_groups/qa"] == 1                                         # ... it is counted here
    assert st["game/informative_groups/fresh"] == 1 and st["game/solver_groups/pool"] == st["game/pool_fills"] == 1
    assert (st["game/pool_servings"], st["game/pool_served_max"]) == (3, 3)
    sh = shares(st)
    assert sh["game/informative_per_slot"] == 0.25                                  # 1 fresh informative of 4 slots
    assert sh["game/empty_slot_share"] == 0.5
    assert sh["game/informative_share"] == pytest.approx(2 / 3)    # the old share: replays in, empty slots out
    assert sh["game/pool_served_mean"] == 3.0
    assert all(is_count(k) for k in ("game/solver_slots", "game/empty_slots", "game/pool_servings"))
    assert not is_count("game/pool_served_max")                                    # a per-rank max: averaged over ranks
    # a round that served no pool question has no max to report (a mean over ranks must not read a 0 there)
    props = [prop(Q, "Paris", row=0)]
    none = round_stats(props, [sol("s0-q0", 1)], [None], {0: True}, 0, None)
    assert "game/pool_served_max" not in none and none["game/pool_servings"] == 0 and none["game/empty_slots"] == 0


def test_the_valid_rate_and_why_each_answer_kind_fails():
    assert [answer_kind(r) for r in HAND_ROWS] == ["name", "name", "fact", "other"]
    assert answer_kind(ProposerRow("Mount Fuji", 3, "chain_end")) == "chain_end"
    assert answer_kind(ProposerRow("Mount Fuji", 3)) == "other"                   # nothing says what it is
    st = hand_round()
    def kind(k: str, reason: str) -> tuple:
        return st[f"game/proposer_trajs/{k}"], st[f"game/valid_questions/{k}"], st[f"game/filter/{k}/{reason}"]
    assert kind("name", "too_short") == (2, 1, 1) and kind("fact", "no_question") == (1, 0, 1)
    assert (st["game/proposer_trajs/other"], st["game/filter/other/rag_failed"]) == (1, 1)
    assert "game/proposer_trajs/chain_end" not in st                              # a kind the round never drew
    assert sum(v for k, v in st.items() if k.startswith("game/filter/name/")) == 1
    assert st["game/filter/too_short"] == 1                                        # the totals stay what they were
    sh = shares(st)
    assert (sh["game/valid_rate/name"], sh["game/valid_rate/fact"], sh["game/valid_rate/other"]) == (0.5, 0.0, 0.0)
    assert "game/valid_rate/chain_end" not in sh
    assert all(is_count(k) for k in st if k.startswith(("game/proposer_trajs/", "game/valid_questions/")))
