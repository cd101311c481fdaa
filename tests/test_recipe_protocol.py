"""The CPU ladder and the demo train under one rollout protocol, and scripts/sft_coldstart.sh builds the demo mix
for that same protocol (issue 31). The smoke tests of both scripts then check the mix they trained on, demo by
demo (tests/test_learning_proof_script.py, tests/test_demo_script.py)."""

from tests.recipe_protocol import REPO, script_protocol, sft_protocol


def test_the_ladder_the_demo_and_the_sft_mix_share_one_protocol():
    """One rollout protocol; the mix's proposer demos search a count each game accepts, and ask questions at
    least as long as each game's floor (the ladder accepts one search where the demos take two)."""
    ladder = script_protocol(REPO / "scripts" / "learning_proof_cpu.sh")
    demo = script_protocol(REPO / "scripts" / "demo_cpu.sh")
    sft = sft_protocol()
    assert ladder == demo, (ladder, demo)
    rollout = lambda p: (p.max_turns, p.max_tokens_per_turn, p.max_info_tokens)  # noqa: E731
    assert rollout(ladder) == rollout(sft), (ladder, sft)
    assert ladder.min_searches <= sft.min_searches and ladder.min_question_words <= sft.min_question_words
    assert ladder.max_turns == 3 and ladder.max_tokens_per_turn == 64     # what the measured runs use


def test_the_reader_sees_a_changed_default(tmp_path):
    s = tmp_path / "s.sh"
    s.write_text('CAP=${CAP:-48}\nP=(--max_turns 4 --max_tokens_per_turn "$CAP" --max_info_tokens 200)\n'
                 "T=(--min_searches 3 --min_question_words 6)\n")
    p = script_protocol(s)
    assert (p.max_turns, p.max_tokens_per_turn, p.max_info_tokens, p.min_searches, p.min_question_words) == (4, 48, 200, 3, 6)
