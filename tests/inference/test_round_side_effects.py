"""What a round leaves outside its trajectories (issue 40, 8): the policy's search counts hold only the policy's
searches (not the metric probe's), and the two roles sample from seed streams of their own."""

from __future__ import annotations

import pytest

from inference.data import ProposerRow
from inference.engine_api import per_prompt_sampling
from inference.game import GameConfig, play_round
from inference.judge import Judge
from inference.rollout import RolloutConfig
from tests.inference.test_pipeline import tokenizer  # noqa: F401 - the fixture
from tests.scripted_policy import ScriptedPolicy
from training.loop.search import TimedSearch

pytestmark = pytest.mark.timeout(300)


class Recording(ScriptedPolicy):
    """The scripted policy, recording (role, seed) of every turn it samples."""

    def __init__(self, tok):
        super().__init__(tok)
        self.seeds = []

    def generate(self, prompts, sampling):
        for p, s in zip(prompts, per_prompt_sampling(sampling, len(prompts))):
            self.seeds.append(("proposer" if "You set puzzles" in self.tokenizer.decode(p) else "solver", s.seed))
        return super().generate(prompts, sampling)


@pytest.mark.parametrize("schedule", ["turn", "trajectory"])
def test_search_counts_hold_the_policys_searches_only_and_roles_have_their_own_seeds(tokenizer, bm25, schedule):  # noqa: F811
    timed = TimedSearch(bm25)
    engine = Recording(tokenizer)
    rows = [ProposerRow(["Abraham Lincoln", "Lincoln"], 2), ProposerRow("Algeria", 2)]
    cfg = GameConfig(proposer_n=2, solver_n=2, rag_verify="off", min_searches=2, seed=5)
    rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=32, max_info_tokens=128, topk=2, seed=3, schedule=schedule)
    res = play_round(engine, rows, timed.search, Judge(), cfg, rcfg, step=1)
    made = sum(t.num_searches for t in res.trajectories)
    assert res.stats["game/valid_questions"] == 2 and "game/valid_one_search" in res.stats  # the probe ran
    assert timed.queries == made, f"{timed.queries} queries counted for {made} searches the policy made"
    seeds = {role: {s for r, s in engine.seeds if r == role} for role in ("proposer", "solver")}
    assert seeds["proposer"] and seeds["solver"] and not seeds["proposer"] & seeds["solver"]
