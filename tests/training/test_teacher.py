"""The self-distillation teacher's plumbing (training/algorithm/teacher.py): which solver trajectory gets a teacher,
what the teacher sees (its own prompt, then the student's response token for token), how its log-probs
line up with the student's tokens, and the dense term added to the advantages.

The teacher's log-probs are checked against a plain-torch forward of the tiny random model on the
teacher sequence built independently from inference/prompts.py."""

from __future__ import annotations

import pytest
import torch

from inference.prompts import build_solver_prompt, build_teacher_prompt, teacher_context
from inference.trajectory import GameMeta, Trajectory
from training.algorithm.self_distill import dense_term
from training.algorithm.teacher import (TopKTerm, apply_sampled, coverage_sums, finish_metrics, privileged_block, teacher_logprobs,
                              teacher_trajectory)

QCP = {"queries": ["1900 Olympics host", "Paris river"],
       "docs": [[{"id": "1", "contents": "1900 Summer Olympics\nThe games were held in Paris."}],
                [{"id": "2", "contents": "Seine\nThe Seine flows through Paris."}]]}
QUESTION = "Which river flows through the city that hosted the 1900 Olympics?"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def solver(tok, qcp=QCP, question=QUESTION, source="proposer", seed=0) -> Trajectory:
    """A solver trajectory as the rollout builds it: prompt, a sampled turn, an info block (mask 0), a sampled turn."""
    g = torch.Generator().manual_seed(seed)
    prompt = build_solver_prompt(tok, question, "auto")
    turn1 = tok("<search> Paris river </search>", add_special_tokens=False)["input_ids"]
    info = tok("\n\n<information>Doc 1 (Title: Seine) The Seine flows.</information>\n\n", add_special_tokens=False)["input_ids"]
    turn2 = tok("<answer> Seine </answer>", add_special_tokens=False)["input_ids"]
    ids = prompt + turn1 + info + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(info) + [1] * len(turn2)
    lps = [(-torch.rand(1, generator=g).item() if m else 0.0) for m in mask]
    return Trajectory("solver", "s0-q0", ids, mask, lps, prompt_len=len(prompt), question=question, answer=["Seine"],
                      meta=GameMeta(qcp=qcp, source=source))


def test_who_gets_a_teacher(tok):
    assert privileged_block(solver(tok), tok, 256, hint=False) == teacher_context(tok, ["Seine"], QCP["queries"],
                                                                                   QCP["docs"], 256)
    qa = solver(tok, qcp=None, source="qa")
    assert privileged_block(qa, tok, 256, hint=False) is None
    assert privileged_block(qa, tok, 256, hint=True) == teacher_context(tok, ["Seine"], None, None, 256)


def test_teacher_sequence_is_its_prompt_then_the_students_response(tok):
    t = solver(tok)
    tp = build_teacher_prompt(tok, QUESTION, privileged_block(t, tok, 256, False), "auto")
    s = teacher_trajectory(t, tp)
    assert s.token_ids[:len(tp)] == tp and s.prompt_len == len(tp)
    assert s.token_ids[len(tp):] == t.token_ids[t.prompt_len:]          # every response token, info blocks too
    assert s.loss_mask == [0] * len(tp) + t.loss_mask[t.prompt_len:]     # info tokens stay out of the term
    assert t.token_ids[:t.prompt_len] != tp                              # the student's prompt is not the teacher's


def test_teacher_logprobs_line_up_with_the_students_tokens(tok, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def plain(ids: list[int]) -> torch.Tensor:   # log p(token_i | tokens before i), 0 for the first
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        return torch.cat([torch.zeros(1), logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])

    calls = []

    def forward(seqs):
        calls.append(len(seqs))
        return [plain(s.token_ids) for s in seqs]

    with_qcp, qa = solver(tok), solver(tok, qcp=None, source="qa", seed=1)
    prop = Trajectory("proposer", "s0-p0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], prompt_len=1)
    out, blocks = teacher_logprobs([with_qcp, prop, qa], tok, "auto", 256, False, forward)
    assert out[1] is None and out[2] is None and blocks[1] is None and blocks[2] is None and calls == [1]
    # independent: the teacher sequence rebuilt from inference/prompts.py, scored whole
    tp = build_teacher_prompt(tok, QUESTION, teacher_context(tok, ["Seine"], QCP["queries"], QCP["docs"], 256), "auto")
    want = plain(tp + with_qcp.token_ids[with_qcp.prompt_len:])[len(tp):]
    got = out[0]
    assert got.shape == (len(with_qcp.token_ids),) and torch.equal(got[:with_qcp.prompt_len], torch.zeros(with_qcp.prompt_len))
    torch.testing.assert_close(got[with_qcp.prompt_len:], want, rtol=0, atol=1e-6)
    student = plain(with_qcp.token_ids)[with_qcp.prompt_len:]   # the privileged prompt changes the scores
    m = torch.tensor(with_qcp.loss_mask[with_qcp.prompt_len:], dtype=torch.bool)
    assert (got[with_qcp.prompt_len:][m] - student[m]).abs().max() > 1e-4
    out_hint, _ = teacher_logprobs([with_qcp, prop, qa], tok, "auto", 256, True, forward)
    assert out_hint[2] is not None and calls[-1] == 2


def test_dense_term_on_sampled_tokens_only_and_beta_zero_is_exact(tok):
    a, b = solver(tok), solver(tok, qcp=None, source="qa", seed=1)
    prop = Trajectory("proposer", "s0-p0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], prompt_len=1)
    trajs = [a, prop, b]
    g = torch.Generator().manual_seed(3)
    adv = [torch.randn(len(t.token_ids), generator=g) for t in trajs]
    student = [torch.tensor(t.logprobs) for t in trajs]
    teacher = [torch.randn(len(a.token_ids), generator=g), torch.randn(3, generator=g), None]
    new, sums = apply_sampled(trajs, adv, student, teacher, 0.0)
    assert all(torch.equal(x, y) for x, y in zip(new, adv))
    beta = 0.5
    new, sums = apply_sampled(trajs, adv, student, teacher, beta)
    m = torch.tensor(a.loss_mask, dtype=torch.bool)
    want = adv[0].clone()
    want[m] += beta * (teacher[0][m] - student[0][m])
    torch.testing.assert_close(new[0], want, rtol=0, atol=1e-7)
    assert torch.equal(new[1], adv[1]) and torch.equal(new[2], adv[2])   # a proposer, a solver without a teacher
    n_a, n_b = float(m.sum()), float(sum(b.loss_mask))
    assert sums["covered"] == n_a and sums["solver_tokens"] == n_a + n_b and sums["with_teacher"] == 1
    met = finish_metrics(sums, beta)
    gap = float((teacher[0][m] - student[0][m]).mean())
    assert met["distill/logp_gap"] == pytest.approx(gap) and met["distill/kl"] == pytest.approx(-gap)
    assert met["distill/coverage"] == pytest.approx(n_a / (n_a + n_b)) and met["distill/beta"] == beta


@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_dense_term_is_the_trainers_wiring_of_each_mode(tok, mode):
    """dense_term (what Trainer._distill calls): sampled == teacher_logprobs + apply_sampled, topk == the
    advantages untouched, coverage_sums and a TopKTerm; both label the trajectories with their teacher's block."""
    from training.settings.config import Config

    a, b = solver(tok), solver(tok, qcp=None, source="qa", seed=1)
    trajs = [a, b]
    g = torch.Generator().manual_seed(5)
    adv = [torch.randn(len(t.token_ids), generator=g) for t in trajs]
    old = [torch.tensor(t.logprobs) for t in trajs]
    cfg = Config()
    cfg.distill.distill, cfg.distill.distill_context_tokens = mode, 256
    lp = {len(s.token_ids): -torch.rand(len(s.token_ids), generator=g) for s in
          [teacher_trajectory(a, build_teacher_prompt(tok, QUESTION, privileged_block(a, tok, 256, False), "auto"))]}
    fwd = ((lambda seqs: [lp[len(s.token_ids)] for s in seqs]) if mode == "sampled" else
           (lambda seqs: [(torch.zeros(len(s.token_ids), 3, dtype=torch.long), lp[len(s.token_ids)][:, None].repeat(1, 3))
                          for s in seqs]))
    new, sums, term = dense_term(trajs, adv, old, 0.25, fwd, tok, cfg)
    teacher, blocks = teacher_logprobs(trajs, tok, "auto", 256, False, fwd)
    if mode == "sampled":
        want, want_sums = apply_sampled(trajs, adv, old, teacher, 0.25)
        assert term is None and sums == want_sums and all(torch.equal(x, y) for x, y in zip(new, want))
    else:
        assert isinstance(term, TopKTerm) and term.beta == 0.25 and term.k == 3
        assert new is adv and sums == coverage_sums(trajs, teacher)
    assert a.teacher_context == blocks[0] and b.teacher_context is None


def test_topk_teacher_rows_line_up_with_the_students_tokens(tok, tiny_model_dir):
    """--distill topk: a forward returning (ids, log-probs) per teacher sequence (forward_topk's form) gets
    each aligned to the student's tokens like the sampled log-probs, zero rows on the student's prompt;
    checked against torch.topk of a plain forward on the teacher sequence built from inference/prompts.py."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    k = 5

    def plain_topk(ids: list[int]):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        top = logp[:-1].topk(k, -1)
        return (torch.cat([torch.zeros(1, k, dtype=torch.long), top.indices]),
                torch.cat([torch.zeros(1, k), top.values]))

    with_qcp, qa = solver(tok), solver(tok, qcp=None, source="qa", seed=1)
    out, _ = teacher_logprobs([with_qcp, qa], tok, "auto", 256, False, lambda seqs: [plain_topk(s.token_ids) for s in seqs])
    assert out[1] is None
    tp = build_teacher_prompt(tok, QUESTION, teacher_context(tok, ["Seine"], QCP["queries"], QCP["docs"], 256), "auto")
    want_ids, want_lps = plain_topk(tp + with_qcp.token_ids[with_qcp.prompt_len:])
    ids, lps = out[0]
    n, p = len(with_qcp.token_ids), with_qcp.prompt_len
    assert ids.shape == (n, k) and lps.shape == (n, k) and ids.dtype == torch.long
    assert not ids[:p].any() and not lps[:p].any()
    assert torch.equal(ids[p:], want_ids[len(tp):])
    torch.testing.assert_close(lps[p:], want_lps[len(tp):], rtol=0, atol=1e-6)
    # the coverage sums and metrics of topk mode: no advantage change, the kl comes from the update
    prop = Trajectory("proposer", "s0-p0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], prompt_len=1)
    sums = coverage_sums([with_qcp, prop, qa], [out[0], None, None])
    n_a, n_b = float(sum(with_qcp.loss_mask)), float(sum(qa.loss_mask))
    assert sums == {"covered": n_a, "solver_tokens": n_a + n_b, "with_teacher": 1.0}
    met = finish_metrics(sums, 0.2)
    assert "distill/kl" not in met and "distill/logp_gap" not in met
    assert met["distill/coverage"] == pytest.approx(n_a / (n_a + n_b)) and met["distill/beta"] == 0.2
    term = TopKTerm([with_qcp, prop, qa], [out[0], None, None], 0.2, 1.0)
    flags = term.per_token([2, 0])["distill_teacher"]
    assert torch.equal(flags[0], torch.zeros(len(qa.token_ids)))
    assert torch.equal(flags[1], torch.ones(n)) and term.k == k


def test_forward_topk_refuses_k_beyond_the_vocabulary(tiny_model_dir):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from training.algorithm.teacher import forward_topk
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    v = model.get_output_embeddings().out_features
    for k in (0, v + 1):
        with pytest.raises(ValueError, match=rf"--distill_topk {k} must be in \[1, {v}\]"):
            forward_topk(SimpleNamespace(module=model, device="cpu"), [], k, 1.0, 256)


def test_topk_term_loss_covers_masked_teacher_tokens_only_and_skips_nonfinite():
    """TopKTerm.add_loss on one packed micro-batch of two sequences (the second without a teacher):
    beta x the covered tokens' KL over the normaliser; NaN off the covered tokens changes nothing;
    NaN on a covered token turns the micro-batch into policy_loss's skip (zero added, flagged)."""
    from types import SimpleNamespace

    t1 = Trajectory("solver", "g", [1, 2, 3, 4, 5], [0, 1, 1, 0, 1], [0.0] * 5, prompt_len=1)
    t2 = Trajectory("solver", "g", [1, 2, 3], [0, 1, 1], [0.0] * 3, prompt_len=1)
    term = TopKTerm([t1, t2], [(torch.zeros(5, 3, dtype=torch.long), torch.zeros(5, 3)), None], 0.25, 1.0)
    flags = term.per_token([0, 1])["distill_teacher"]
    mb = SimpleNamespace(tensors={"loss_mask": torch.tensor(t1.loss_mask + t2.loss_mask),
                                  "distill_teacher": torch.cat(flags)}, cu_seqlens=torch.tensor([0, 5, 8]))
    nan = float("nan")
    kl = torch.tensor([nan, 0.5, 1.5, nan, 2.0, nan, 7.0, nan], requires_grad=True)   # covered: 1, 2, 4
    base = torch.tensor(3.0, requires_grad=True)
    loss, m = term.add_loss((base * 1.0, {"actor/nonfinite": torch.zeros(())}), mb, kl, 10.0, "token-mean")
    assert float(loss.detach()) == pytest.approx(3.0 + 0.25 * 4.0 / 10.0) and float(m["distill/kl_loss"]) == pytest.approx(0.1)
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([0.0, 1, 1, 0, 1, 0, 0, 0]) * 0.25 / 10.0, rtol=1e-6, atol=0)
    assert term.metrics() == {"distill/kl": pytest.approx(4.0 / 3)}
    kl2 = kl.detach().clone().requires_grad_(True)
    kl2.data[2] = nan                                                                  # a covered token
    loss, m = term.add_loss((base * 1.0, {"actor/nonfinite": torch.zeros(())}), mb, kl2, 10.0, "token-mean")
    assert float(loss.detach()) == 3.0 and float(m["actor/nonfinite"]) == 1.0 and "distill/kl_loss" not in m
    loss.backward()
    assert torch.equal(kl2.grad, torch.zeros(8))
    skipped = (base * 0.0, {"actor/nonfinite": torch.ones(()), "actor/num_tokens": torch.zeros(())})
    assert term.add_loss(skipped, mb, kl, 10.0, "token-mean") is skipped              # policy_loss skipped it
    assert term.metrics() == {"distill/kl": pytest.approx(4.0 / 3)}                    # nothing added since
