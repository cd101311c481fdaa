"""Simulated search (ZeroSearch) at TP > 1 (issue 40, 1): served through --sim_url it runs in the pipelined round,
where a tensor-parallel group's first rank alone asks the simulator and shares its documents, so both ranks feed
their engines the same prompts. Before, simulated search forced the staged round, in which every rank asked the
simulator itself; an unseeded simulator (temperature 0.8) wrote each rank other documents and split the group.
The staged round is gone (issue 43, 1): a simulator on the policy's own engine plays the same pipeline in waves."""

from __future__ import annotations

import random
import threading
from http.server import ThreadingHTTPServer

import pytest

from inference.rollout import RolloutConfig, needs_barrier
from inference.simulated_search import SimulatedSearch
from tests.inference.test_pipeline import _same_round, tokenizer  # noqa: F401 - the fixture
from tests.inference.test_rollout_schedule import GroupRank, ThreadGroup
from training.loop.search import TimedSearch
from tests.json_server import JSONHandler
from tests.scripted_policy import ScriptedPolicy

pytestmark = pytest.mark.timeout(300)


class Unseeded(JSONHandler):
    """An OpenAI-compatible simulator that samples as a real one at temperature 0.8 does without a seed: every
    document differs, whoever asks. It stands in for the simulator LLM, whose text this test does not read."""
    rng = random.Random()
    asked = 0

    def do_GET(self):  # noqa: N802
        self._reply({"data": [{"id": "sim"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).asked += 1
        text = f"Title: Page {self.rng.randrange(10**6)}\nA passage about Lincoln, number {self.rng.randrange(10**6)}."
        self._reply({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]})



@pytest.fixture
def sim_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Unseeded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Unseeded.asked = 0
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_served_simulator_runs_beside_the_engine_and_an_in_process_one_between_waves(sim_url, tokenizer):  # noqa: F811
    served = TimedSearch(SimulatedSearch(url=sim_url, model="sim"))
    rcfg = RolloutConfig()
    assert not needs_barrier(rcfg, served.search, served.search)
    in_process = TimedSearch(SimulatedSearch(engine=ScriptedPolicy(tokenizer), template="qwen"))
    assert needs_barrier(rcfg, served.search, in_process.search)
    assert needs_barrier(RolloutConfig(schedule="turn"), served.search)


@pytest.mark.parametrize("schedule", ["trajectory", "turn"])
def test_simulated_search_keeps_two_lockstep_ranks_identical(sim_url, tokenizer, schedule):  # noqa: F811
    """Both schedules: the turn schedule is the same loop in waves (issue 43, 1), so it keeps the lockstep too; it
    was refused at TP > 1 while it was a staged round that asked on every rank."""
    from tests.inference.test_pipeline import _play_with, CountingJudge

    group = ThreadGroup()
    ranks = [GroupRank(ScriptedPolicy(tokenizer), group, r) for r in (0, 1)]
    sims = [TimedSearch(SimulatedSearch(url=sim_url, model="sim", seed=r, timeout_s=10)) for r in (0, 1)]
    out, errors = [None, None], [None, None]

    def go(r):
        try:
            out[r] = _play_with(ranks[r], sims[r].search, CountingJudge(), schedule)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert errors == [None, None] and out[0] is not None and out[1] is not None, errors
    assert sims[0].calls > 0 and sims[1].calls == 0, "the second rank asked the simulator itself"
    assert ranks[0].calls == ranks[1].calls
    flag = 1.0 if schedule == "trajectory" else 0.0
    _same_round(out[0], out[1], pipelined=(flag, flag))
    docs = [d["contents"] for t in out[1].trajectories for call in (t.docs or []) for d in call]
    assert docs and all(d.startswith("Page ") for d in docs)   # the simulator's documents, shared
