"""--distill contrast (training/algorithm/contrast.py, issue 32) against an independent reference.

The teacher's log-probs under the right and the wrong privileged block come from the trainer's packed
forward (pack_equal + engine_logprobs, several teacher sequences per packed row, as Trainer.forward_logprobs
runs them) and are checked against a plain eager forward of each full teacher sequence, the sequence
rebuilt here from inference/prompts.py and the test's own table of questions; the advantages against a
loop over tokens computing beta * (lp_right - lp_wrong) by hand from those plain forwards."""

from __future__ import annotations

import random

import pytest
import torch

from inference.prompts import build_solver_prompt, build_teacher_prompt, teacher_context
from inference.trajectory import GameMeta, Trajectory
from training.settings.config import Config
from training.algorithm.contrast import apply_contrast, contrast_logprobs, wrong_paths
from training.algorithm.self_distill import dense_term
from training.algorithm.teacher import finish_metrics

MAX_CTX = 256


def _doc(i, text):
    return [{"id": str(i), "contents": text}]


# question -> (answer, construction path); Q_LOUVRE shares Seine with Q_RIVER, so it is never its wrong path
Q_RIVER = "Which river flows through the city that hosted the 1900 Olympics?"
Q_TOWER = "Which city is home to the Eiffel Tower?"
Q_FLOOD = "In which year did the great flood of Paris happen?"
Q_LOUVRE = "Which river runs past the Louvre?"
TABLE = {
    Q_RIVER: (["Seine"], {"queries": ["1900 Olympics host", "Paris river"],
                          "docs": [_doc(1, "1900 Summer Olympics\nThe games were held in Paris."),
                                   _doc(2, "Seine\nThe Seine flows through Paris.")]}),
    Q_TOWER: (["Paris"], {"queries": ["Eiffel Tower"], "docs": [_doc(3, "Eiffel Tower\nA tower in Paris, France.")]}),
    Q_FLOOD: (["1910"], {"queries": ["Paris flood"], "docs": [_doc(4, "1910 Paris flood\nThe Seine rose in 1910.")]}),
    Q_LOUVRE: (["seine"], {"queries": ["Louvre river"], "docs": [_doc(5, "Louvre\nThe museum stands on the Seine.")]}),
}


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def solver(tok, question, seed=0, qcp="table", group=None) -> Trajectory:
    """A solver trajectory as the rollout builds it: prompt, a sampled turn, an info block (mask 0), a sampled turn."""
    g = torch.Generator().manual_seed(seed)
    answer, path = TABLE[question]
    prompt = build_solver_prompt(tok, question, "auto")
    turn1 = tok(f"<search> {question[:20]} </search>", add_special_tokens=False)["input_ids"]
    info = tok("\n\n<information>Doc 1 (Title: Seine) The Seine flows.</information>\n\n", add_special_tokens=False)["input_ids"]
    turn2 = tok(f"<answer> {answer[0]} </answer>" if seed % 2 else "<answer> Lyon </answer>",
                add_special_tokens=False)["input_ids"]
    ids = prompt + turn1 + info + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(info) + [1] * len(turn2)
    lps = [(-torch.rand(1, generator=g).item() if m else 0.0) for m in mask]
    return Trajectory("solver", group or f"s0-q{list(TABLE).index(question)}", ids, mask, lps, prompt_len=len(prompt),
                      question=question, answer=answer,
                      meta=GameMeta(qcp=path if qcp == "table" else qcp, source="proposer"))


def step_trajs(tok) -> list[Trajectory]:
    """Two samples of three questions, one of Q_LOUVRE, a proposer and a fixed QA row (no path)."""
    prop = Trajectory("proposer", "s0-p0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], prompt_len=1)
    qa = solver(tok, Q_TOWER, seed=9, qcp=None, group="s0-q9")
    qa.question, qa.answer = "Who wrote Les Miserables?", ["Victor Hugo"]
    return [solver(tok, q, seed=s) for q in (Q_RIVER, Q_TOWER, Q_FLOOD) for s in (0, 1)] + \
        [solver(tok, Q_LOUVRE, seed=3), prop, qa]


class _Engine:
    """What Trainer.forward_logprobs uses of a DeepSpeed engine: .module, .device, and engine() runs its forward."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self):
        return self.module()


def packed_forward(model, budget=1024):
    """Trainer.forward_logprobs on a plain model: pack, one sequence_logprobs per micro-batch, unpack."""
    from training.algorithm.packing import unpack_to_sequences
    from training.algorithm.micro_batches import engine_logprobs, pack_equal

    def fwd(seqs):
        fwd.calls.append(len(seqs))
        with torch.no_grad():
            mbs, n_real = pack_equal(seqs, budget)
            fwd.rows.append([len(mb.seq_indices) for mb in mbs])
            outs = [engine_logprobs(_Engine(model), mb, 1.0)[0].float() for mb in mbs]
        return unpack_to_sequences(mbs[:n_real], outs[:n_real], len(seqs)) if seqs else []
    fwd.calls, fwd.rows = [], []
    return fwd


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens before i) of one whole sequence, eager attention, 0 for the first."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.cat([torch.zeros(1), logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])


def reference_teacher(model, tok, t: Trajectory, question_of_block: str) -> torch.Tensor:
    """The teacher's log-probs of t's response given question_of_block's path, aligned to t.token_ids."""
    answer, path = TABLE[question_of_block]
    block = teacher_context(tok, answer, path["queries"], path["docs"], MAX_CTX)
    tp = build_teacher_prompt(tok, t.question, block, "auto")
    return torch.cat([torch.zeros(t.prompt_len), plain_logprobs(model, tp + t.token_ids[t.prompt_len:])[len(tp):]])


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    load = lambda impl: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,   # noqa: E731
                                                             attn_implementation=impl).eval()
    return load("sdpa"), load("eager")     # packed (varlen SDPA), and the plain reference


def contrast_cfg(beta_seed=0, hint=False) -> Config:
    cfg = Config()
    cfg.distill.distill, cfg.distill.distill_context_tokens, cfg.distill.distill_hint = "contrast", MAX_CTX, hint
    cfg.optimisation.seed = beta_seed
    return cfg


# ----------------------------------------------------------------------------- (e) the wrong path

def test_wrong_path_is_another_questions_never_its_own_and_deterministic(tok):
    trajs = step_trajs(tok)
    seen = set()
    for step in range(12):
        wrong = wrong_paths(trajs, False, (), seed=3, step=step)
        for t, w in zip(trajs, wrong):
            if t.role != "solver" or not t.meta.qcp:
                assert w is None
                continue
            assert w is not None and w["question"] != t.question          # never the trajectory's own
            assert w["question"] in TABLE and w["qcp"] == TABLE[w["question"]][1]
            assert not {a.lower() for a in w["answer"]} & {a.lower() for a in t.answer}   # never the same answer
            seen.add((t.question, w["question"]))
        for a, b in zip(trajs, trajs[1:]):                               # one wrong path per group
            if a.question == b.question:
                assert wrong[trajs.index(a)] is wrong[trajs.index(b)]
        again = wrong_paths(trajs, False, (), seed=3, step=step)         # a re-run (a resumed step, another rank's
        order = list(range(len(trajs)))                                 # identical view) draws the same, in any order
        random.Random(step).shuffle(order)
        shuffled = wrong_paths([trajs[i] for i in order], False, (), seed=3, step=step)
        assert again == wrong and [shuffled[order.index(i)] for i in range(len(trajs))] == wrong
    # the draw moves with the step: every allowed pair of Q_RIVER's is drawn over 12 steps, Q_LOUVRE never for it
    assert {w for q, w in seen if q == Q_RIVER} == {Q_TOWER, Q_FLOOD}
    assert (Q_LOUVRE, Q_RIVER) not in seen and (Q_RIVER, Q_LOUVRE) not in seen


def test_a_rank_with_one_question_takes_a_pool_path_or_gets_none(tok):
    alone = [solver(tok, Q_RIVER, seed=0), solver(tok, Q_RIVER, seed=1), solver(tok, Q_LOUVRE, seed=2)]
    assert wrong_paths(alone, False, (), seed=0, step=0) == [None] * 3          # Q_LOUVRE states the same answer
    pool = [{"question": Q_RIVER, "answer": ["Seine"], "qcp": TABLE[Q_RIVER][1]},        # its own question
            {"question": "Seeded row?", "answer": ["X"]},                               # no path: not without a hint
            {"question": Q_FLOOD, "answer": ["1910"], "qcp": TABLE[Q_FLOOD][1], "step": 3}]
    wrong = wrong_paths(alone, False, pool, seed=0, step=0)
    assert [w["question"] for w in wrong] == [Q_FLOOD] * 3
    # a question the rank played this step but does not train on (a flat group left out) comes before the pool
    played = alone + [solver(tok, Q_TOWER, seed=5)]
    assert [w["question"] for w in wrong_paths(alone, False, pool, seed=0, step=0, played=played)] == [Q_TOWER] * 3
    # --distill_hint: a hint (answer alone) is contrasted with another hint, a path with another path
    qa = solver(tok, Q_TOWER, seed=9, qcp=None)
    w_hint = wrong_paths(alone + [qa], True, pool, seed=0, step=0)
    assert w_hint[3] == {"question": "Seeded row?", "answer": ["X"], "qcp": None}
    assert [w["question"] for w in w_hint[:3]] == [Q_FLOOD] * 3


# ----------------------------------------------------------------------------- (a) + (b) against plain torch

def test_both_teachers_and_the_advantages_match_plain_torch(tok, models):
    packed, eager = models
    trajs = step_trajs(tok)
    n_solver_qcp = sum(1 for t in trajs if t.role == "solver" and t.meta.qcp)
    step, beta = 5, 0.3
    cfg = contrast_cfg(beta_seed=1)
    wrong = wrong_paths(trajs, False, (), cfg.optimisation.seed, step)
    fwd = packed_forward(packed)
    right_lp, wrong_lp, blocks, wblocks = contrast_logprobs(trajs, tok, "auto", MAX_CTX, False, fwd, wrong)
    assert fwd.calls == [2 * n_solver_qcp] and max(max(r) for r in fwd.rows) > 1   # ONE call, sequences packed together
    ref = {}
    for i, t in enumerate(trajs):
        if wrong[i] is None:
            assert right_lp[i] is None and wrong_lp[i] is None and wblocks[i] is None
            continue
        want_r, want_w = reference_teacher(eager, tok, t, t.question), reference_teacher(eager, tok, t, wrong[i]["question"])
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert right_lp[i].shape == want_r.shape and not right_lp[i][~m].any() and not wrong_lp[i][~m].any()
        torch.testing.assert_close(right_lp[i][m], want_r[m], rtol=0, atol=1e-5)     # measured 2e-6
        torch.testing.assert_close(wrong_lp[i][m], want_w[m], rtol=0, atol=1e-5)
        assert (want_r[m] - want_w[m]).abs().max() > 1e-3          # the two blocks do move the teacher
        ref[i] = (want_r, want_w)

    # (b) the trainer's wiring (dense_term) against a loop over tokens
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(t.token_ids), generator=g) for t in trajs]
    old = [torch.tensor(t.logprobs) for t in trajs]
    fwd2 = packed_forward(packed)
    new, sums, term = dense_term(trajs, adv, old, beta, fwd2, tok, cfg, (), step)
    assert term is None and fwd2.calls == [2 * n_solver_qcp]
    gaps, n_both, n_solver, lp_gaps = [], 0, 0, []
    for i, t in enumerate(trajs):
        want = adv[i].clone()
        for p in range(len(t.token_ids)):
            if t.role == "solver" and t.loss_mask[p]:
                n_solver += 1
                if i in ref:
                    r, w = float(ref[i][0][p]), float(ref[i][1][p])
                    want[p] = float(adv[i][p]) + beta * (r - w)
                    gaps.append(r - w)
                    lp_gaps.append(r - float(old[i][p]))
                    n_both += 1
        torch.testing.assert_close(new[i], want, rtol=0, atol=1e-5)
        if i not in ref:
            assert torch.equal(new[i], adv[i])
    met = finish_metrics(sums, beta)
    assert met["distill/contrast_gap"] == pytest.approx(sum(gaps) / n_both, abs=1e-5)
    assert met["distill/contrast_coverage"] == pytest.approx(n_both / n_solver) and met["distill/with_contrast"] == len(ref)
    assert met["distill/logp_gap"] == pytest.approx(sum(lp_gaps) / n_both, abs=1e-5)   # sampled's, vs the right path
    assert met["distill/kl"] == pytest.approx(-met["distill/logp_gap"])
    assert met["distill/coverage"] == pytest.approx(n_both / n_solver) and met["distill/beta"] == beta
    assert 0 < n_both < n_solver                           # the QA row has no teacher and counts out
    i = next(iter(ref))
    ctx = trajs[i].teacher_context                 # samples/ shows both blocks
    assert ctx.startswith(blocks[i]) and ctx.endswith(wblocks[i]) and "the wrong one" in ctx


# ----------------------------------------------------------------------------- (c) alike scores give exactly 0

def test_identical_blocks_give_exactly_zero(tok, models):
    """The wrong path set to the right one: both teachers read the same sequence, so every term is 0 and
    the advantages come back exactly, through the packed forward too."""
    packed, eager = models
    trajs = step_trajs(tok)
    own = [{"question": t.question, "answer": t.answer, "qcp": t.meta.qcp}
           if t.role == "solver" and t.meta.qcp else None for t in trajs]
    adv = [torch.randn(len(t.token_ids), generator=torch.Generator().manual_seed(i)) for i, t in enumerate(trajs)]
    old = [torch.tensor(t.logprobs) for t in trajs]
    plain = lambda seqs: [plain_logprobs(eager, s.token_ids) for s in seqs]   # noqa: E731
    for fwd in (plain, packed_forward(packed)):
        right, wrong, blocks, wblocks = contrast_logprobs(trajs, tok, "auto", MAX_CTX, False, fwd, own)
        assert blocks == wblocks
        new, sums = apply_contrast(trajs, adv, old, right, wrong, 0.7)
        assert sums["contrast_sum"] == 0.0 and sums["with_contrast"] == 7
        assert all(torch.equal(a, b) for a, b in zip(new, adv))


def test_a_context_blind_teacher_scores_every_token_alike(tok, tiny_model_dir):
    """A model whose attention writes nothing (every o_proj zero) predicts from the current token alone, so
    the logits at each response position are the same whatever the privileged block: the contrast is exactly
    0 on every token, while each teacher still differs from the student (sampled would move the advantages)."""
    from transformers import AutoModelForCausalLM
    blind = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in blind.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    trajs = step_trajs(tok)
    wrong = wrong_paths(trajs, False, (), 0, 0)
    right, wrong_lp, blocks, wblocks = contrast_logprobs(trajs, tok, "auto", MAX_CTX, False,
                                                         lambda seqs: [plain_logprobs(blind, s.token_ids) for s in seqs],
                                                         wrong)
    adv = [torch.randn(len(t.token_ids), generator=torch.Generator().manual_seed(i)) for i, t in enumerate(trajs)]
    old = [torch.tensor(t.logprobs) for t in trajs]
    new, sums = apply_contrast(trajs, adv, old, right, wrong_lp, 1.0)
    covered = [i for i, w in enumerate(wblocks) if w is not None]
    assert len(covered) == 7 and all(blocks[i] != wblocks[i] for i in covered)
    assert all(torch.equal(right[i], wrong_lp[i]) for i in covered)
    assert sums["contrast_sum"] == 0.0 and all(torch.equal(a, b) for a, b in zip(new, adv))
    assert abs(sums["gap_sum"]) > 1.0                       # the teacher-student gap sampled would add is not 0


def test_the_term_is_zero_exactly_where_both_teachers_agree():
    """Token by token: where lp_right == lp_wrong the advantage is returned as it was, elsewhere it moves."""
    t = Trajectory("solver", "g", list(range(8)), [0, 1, 1, 1, 0, 1, 1, 1], [0.0] * 8, prompt_len=1)
    g = torch.Generator().manual_seed(4)
    adv, right = torch.randn(8, generator=g), -torch.rand(8, generator=g)
    wrong = right.clone()
    wrong[[2, 6]] -= 0.5                                    # the teachers differ on tokens 2 and 6 only
    new, sums = apply_contrast([t], [adv], [torch.zeros(8)], [right], [wrong], 0.4)
    moved = (new[0] != adv).nonzero().flatten().tolist()
    assert moved == [2, 6] and torch.allclose(new[0][[2, 6]], adv[[2, 6]] + 0.2)
    assert sums["contrast_sum"] == pytest.approx(1.0) and sums["both"] == 6


# ----------------------------------------------------------------------------- (d) coefficient 0

def test_coefficient_zero_leaves_the_advantages_of_distill_off(tok):
    """beta 0: the advantages ppo_update gets are bitwise those of --distill off (which passes them untouched),
    and contrast adds no loss term, so the update is the same; the metrics are still reported."""
    trajs = step_trajs(tok)
    adv = [torch.randn(len(t.token_ids), generator=torch.Generator().manual_seed(i)) for i, t in enumerate(trajs)]
    adv[0][3] = -0.0
    off = [a.clone() for a in adv]
    old = [torch.tensor(t.logprobs) for t in trajs]
    fwd = lambda seqs: [-torch.rand(len(s.token_ids)) for s in seqs]   # noqa: E731   any teacher
    new, sums, term = dense_term(trajs, adv, old, 0.0, fwd, tok, contrast_cfg(), (), 0)
    assert term is None
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(new, off))
    assert sums["with_contrast"] == 7 and finish_metrics(sums, 0.0)["distill/contrast_coverage"] > 0


def test_no_wrong_path_means_no_term_and_is_counted(tok):
    """A step whose only question has no other to contrast with: its tokens keep their advantages and count
    out of distill/contrast_coverage, not out of distill/coverage (the right teacher still scored them)."""
    trajs = [solver(tok, Q_RIVER, seed=0), solver(tok, Q_RIVER, seed=1)]
    adv = [torch.randn(len(t.token_ids)) for t in trajs]
    fwd = lambda seqs: [-torch.rand(len(s.token_ids)) for s in seqs]   # noqa: E731
    new, sums, _ = dense_term(trajs, adv, [torch.tensor(t.logprobs) for t in trajs], 0.5, fwd, tok, contrast_cfg(), (), 0)
    assert all(torch.equal(a, b) for a, b in zip(new, adv))
    met = finish_metrics(sums, 0.5)
    assert met["distill/contrast_coverage"] == 0.0 and met["distill/with_contrast"] == 0
    assert met["distill/coverage"] == 1.0 and met["distill/contrast_gap"] != met["distill/contrast_gap"]   # NaN
    assert "the wrong one" not in trajs[0].teacher_context


def test_the_trainers_distill_step_runs_contrast(tok, models):
    """SSPTrainer._distill's few lines on a stand-in trainer (its config, step, pool, tokenizer and a
    forward_logprobs over the packed forward): the beta of the schedule, the wrong paths drawn from the
    played trajectories, the metrics reduced (one rank), no loss term."""
    from types import SimpleNamespace

    from inference.game import QuestionPool
    from training.loop.trainer import SSPTrainer

    packed, _ = models
    trajs = step_trajs(tok)
    cfg = contrast_cfg()
    cfg.distill.distill_coef, cfg.distill.distill_schedule, cfg.optimisation.total_steps = 0.4, "linear", 4
    fwd = packed_forward(packed)
    fake = SimpleNamespace(cfg=cfg, step=2, engines=SimpleNamespace(ref=None), actor="the policy", tokenizer=tok,
                           pool=QuestionPool(), forward_logprobs=lambda engine, seqs: fwd(seqs))
    trained = [t for t in trajs if t.question != Q_FLOOD]       # Q_FLOOD's group was left out, but it was played
    adv = [torch.zeros(len(t.token_ids)) for t in trained]
    new, met, term = SSPTrainer._distill(fake, trained, adv, [torch.tensor(t.logprobs) for t in trained], trajs)
    assert term is None and fwd.calls == [2 * 5] and met["distill/beta"] == pytest.approx(0.2)
    assert met["distill/with_contrast"] == 5 and met["distill/contrast_coverage"] > 0
    assert {"distill/kl", "distill/logp_gap", "distill/coverage", "distill/with_teacher",
            "distill/contrast_gap"} <= set(met)
    assert any(bool(a.abs().sum() > 0) for a in new)
