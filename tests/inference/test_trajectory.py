"""Trajectory's typed record of a game (search record, GameMeta, Outcome): it round-trips through to_dict/from_dict,
and the older form, which kept all of it in a free-form `info` dict, still loads."""

import json

import pytest

from inference.trajectory import GameMeta, Outcome, Trajectory

DOCS = [[{"id": "7", "contents": "Paris\nCapital of France.", "score": 1.5}], []]


def _played_solver() -> Trajectory:
    return Trajectory("solver", "s3-q1", [5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], prompt_len=1, reward=0.25,
                      num_turns=2, num_searches=2, response_text="<answer>Paris</answer>", question="Q?",
                      answer=["Paris"], stop_reason="answer", queries=["capital of France", "again"], docs=DOCS,
                      search_failed=1, final_action={"kind": "answer", "content": "Paris"}, cap=None,
                      meta=GameMeta(proposer=4, source="proposer", qcp={"queries": ["a"], "docs": [[]]}),
                      outcome=Outcome(pred="Paris", correct=True, judge_source="em", spam=True,
                                      excluded="search_failed"),
                      teacher_context="<privileged>")


def test_to_dict_round_trips_through_json():
    t = _played_solver()
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    assert isinstance(back.meta, GameMeta) and isinstance(back.outcome, Outcome)
    assert back.outcome.excluded == "search_failed" and back.meta.proposer == 4 and not back.meta.from_pool


def test_an_old_dump_with_an_info_bag_loads_into_the_typed_fields():
    # the form this project wrote before the fields were typed: rollout.py's info dict, game.score's keys,
    # self_distill's teacher_context, and score's copy of meta["from_pool"]
    old_solver = {
        "role": "solver", "group_id": "s3-q1", "token_ids": [5, 6, 7], "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.5, -0.25], "prompt_len": 1, "reward": 0.25, "num_turns": 2, "num_searches": 2,
        "response_text": "<answer>Paris</answer>", "question": "Q?", "answer": ["Paris"], "stop_reason": "answer",
        "info": {"queries": ["capital of France", "again"], "docs": DOCS, "search_failed": 1,
                 "final_action": {"kind": "answer", "content": "Paris"}, "cap": None,
                 "meta": {"proposer": 4, "from_pool": False, "source": "proposer",
                          "qcp": {"queries": ["a"], "docs": [[]]}},
                 "pred": "Paris", "correct": True, "judge_source": "em", "judge_failed": False, "spam": True,
                 "from_pool": False, "excluded": "search_failed", "teacher_context": "<privileged>"}}
    assert Trajectory.from_dict(old_solver) == _played_solver()

    old_proposer = {
        "role": "proposer", "group_id": "s3-p0", "token_ids": [1, 2], "loss_mask": [0, 1], "logprobs": [0.0, -1.0],
        "question": "Which city?", "answer": "Paris", "stop_reason": "max_tokens",
        "info": {"queries": ["Paris"], "docs": DOCS[:1], "search_failed": 0, "final_action": {"kind": None,
                 "content": None}, "cap": "turn", "meta": {"search_turns": 2, "row": 0},
                 "filter_reason": None, "valid": True, "rag": None, "rag_answer": "Paris", "solver_acc": 0.5,
                 "pool_admitted": False, "excluded": "judge_failed"}}
    p = Trajectory.from_dict(old_proposer)
    assert (p.cap, p.queries, p.docs, p.search_failed) == ("turn", ["Paris"], DOCS[:1], 0)
    assert (p.meta.row, p.meta.search_turns, p.meta.proposer, p.meta.source) == (0, 2, None, None)
    assert (p.outcome.valid, p.outcome.filter_reason, p.outcome.rag, p.outcome.rag_answer) == (True, None, None, "Paris")
    assert (p.outcome.solver_acc, p.outcome.pool_admitted, p.outcome.excluded) == (0.5, False, "judge_failed")
    assert p.outcome.correct is None and p.teacher_context is None      # a proposer is never judged

    pooled = dict(old_solver, info={**old_solver["info"], "meta": {"proposer": None, "from_pool": True,
                                                                     "source": "pool", "qcp": None}})
    assert Trajectory.from_dict(pooled).meta.from_pool


def test_an_unknown_info_key_is_refused_not_dropped():
    d = _played_solver().to_dict()
    for k in ("queries", "docs", "search_failed", "final_action", "cap", "meta", "outcome", "teacher_context"):
        d.pop(k)
    d["info"] = {"queries": [], "mystery": 1}
    with pytest.raises(ValueError, match="mystery"):
        Trajectory.from_dict(d)
    with pytest.raises(TypeError):
        Trajectory.from_dict({**_played_solver().to_dict(), "outcome": {"correct": True, "mystery": 1}})


def test_defaults_say_no_stage_has_run():
    t = Trajectory("proposer", "g", [1], [1], [-1.0])
    assert (t.queries, t.docs, t.search_failed, t.cap, t.teacher_context) == ([], [], 0, None, None)
    assert t.outcome == Outcome() and t.outcome.excluded is None and t.outcome.correct is None
    assert t.meta == GameMeta() and not t.meta.from_pool
    # each trajectory owns its record: filling one leaves another's alone
    u = Trajectory("proposer", "g", [1], [1], [-1.0])
    t.outcome.excluded, t.queries = "judge_failed", ["q"]
    assert u.outcome.excluded is None and u.queries == []
