"""Run under torchrun by tests/training/test_distill_topk.py: --distill topk's wiring (training/algorithm/teacher.py
forward_topk and TopKTerm, inside training/algorithm/micro_batches.py accumulate / training/algorithm/update.py ppo_update) under ZeRO-3 over gloo,
against plain torch on the whole batch: full-vocabulary logits of an eager HF forward per unpacked
sequence, log_softmax, torch.topk, and the renormalised reverse KL written out below.

    torchrun --nproc_per_node {1,2} tests/training/distill_worker.py MODEL_DIR OUT.json K[,K2..]

Writes {"K": results, ..}: the phases below run once per K, in one process (a launch costs ~10 CPU-s of start-up).

Phases (the optimizer never steps: engine.step only records the accumulated gradient, so every
phase sees the same weights):
  teacher   forward_topk on the teacher sequences (another prompt, then the student's response) gives
            the reference's top-K ids and log-probs at each loss-masked position, zero rows elsewhere
  term      accumulate() of beta x the top-K term alone, the trajectories packed in reverse order:
            per-token KL and the gradient of every parameter == the reference's, over the whole batch
            (normaliser: all masked tokens, as the policy loss's); the teacher rows off the loss mask
            are poisoned (NaN, id -1) and must change nothing. With K = V the per-token KL is also
            checked against the full-vocabulary KL(p_S || q_T).
  update    ppo_update's accumulated gradient: distill None, TopKTerm at beta 0 (== None to 1e-6) and at
            BETA (minus None == BETA x the reference term's gradient); distill/kl == the reference's mean,
            also over sequential roles x 2 epochs x 2 mini-batches (steps with no covered token included).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_worker import full_grads, make_trajs, rel_err  # noqa: E402  (also runs prepare_launch_env)

import torch  # noqa: E402

from training.settings.config import AlgoArgs, Config  # noqa: E402
from utils import dist as D  # noqa: E402

TEMP, BETA, BUDGET = 0.8, 1.0, 64
NO_TEACHER = (2, 5)          # solver trajectories without privileged context


def teacher_seqs(trajs, vocab: int):
    """A teacher sequence per trajectory with a teacher: 10 other prompt tokens, then its response."""
    from training.algorithm.teacher import teacher_trajectory
    g = torch.Generator().manual_seed(7)
    return {i: teacher_trajectory(t, torch.randint(0, vocab, (10,), generator=g).tolist())
            for i, t in enumerate(trajs) if i not in NO_TEACHER}


def logp_rows(model, ids: list[int]) -> torch.Tensor:
    """(L, V) fp32: row i = log p(. | ids before i) at TEMP (row 0, no prediction, is zeros)."""
    z = model(input_ids=torch.tensor(ids)[None], use_cache=False).logits[0].float() / TEMP
    return torch.cat([torch.zeros(1, z.shape[1]), torch.log_softmax(z[:-1], -1)])


def reference_teacher(model, trajs, seqs, k):
    """Per trajectory None or (ids, log q) (L, k) aligned to its tokens, and the full log q (L, V)."""
    out, full = {}, {}
    with torch.no_grad():
        for i, s in seqs.items():
            t = trajs[i]
            lq = logp_rows(model, s.token_ids)[s.prompt_len:]
            lq = torch.cat([torch.zeros(t.prompt_len, lq.shape[1]), lq])
            top = lq.topk(k, dim=-1)
            out[i], full[i] = (top.indices, top.values), lq
    return out, full


def reference_kl(model, t, teacher) -> torch.Tensor:
    """(L,) per-token sum_k p~(k) (log p~(k) - log q~(k)), ~ = renormalised over the teacher's top-K."""
    ids, lq = teacher
    a = torch.log_softmax(logp_rows(model, t.token_ids).gather(1, ids), -1)
    b = torch.log_softmax(lq, -1)
    return (a.exp() * (a - b)).sum(-1)


def main() -> None:
    import deepspeed

    from transformers import AutoModelForCausalLM

    from training.engine.engine_builder import _load_model, build_ds_config
    from training.algorithm.loss import count_normaliser
    from training.algorithm.packing import unpack_to_sequences
    from training.algorithm.teacher import TopKTerm, forward_topk
    from training.algorithm.micro_batches import accumulate, pack_equal
    from training.algorithm.update import ppo_update

    model_dir, out_path, ks = sys.argv[1], Path(sys.argv[2]), [int(k) for k in sys.argv[3].split(",")]
    D.init_distributed()
    rank, world = D.rank(), D.world_size()
    cfg = Config()
    cfg.model.model_path, cfg.model.dtype, cfg.model.attn_implementation = model_dir, "fp32", "sdpa"
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ds_config = {**build_ds_config(cfg), "zero_allow_untested_optimizer": True}
    model, _keep = _load_model(cfg, ds_config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                      config=ds_config)
    grads: list[dict] = []

    def record_instead_of_step():
        grads.append(full_grads(engine))
        engine.optimizer.zero_grad()
    engine.step = record_instead_of_step

    def phases(k: int) -> dict:
        """Every phase at top-K = k (the weights never move, so each k sees the same model)."""
        vocab = ref.config.vocab_size
        trajs = make_trajs(vocab)
        seqs = teacher_seqs(trajs, vocab)
        mine_idx = list(range(8)) if world == 1 else (list(range(7)) if rank == 0 else [7])
        mine = [trajs[i] for i in mine_idx]
        res: dict = {"world": world, "k": k, "vocab": vocab}
        err = {}

        # ---- teacher: forward_topk against torch.topk of the full log-softmax
        want, want_full = reference_teacher(ref, trajs, seqs, k)
        my_seq_idx = [i for i in mine_idx if i in seqs]
        got_seqs = forward_topk(engine, [seqs[i] for i in my_seq_idx], k, TEMP, BUDGET)
        teacher: list = [None] * len(mine)
        id_mismatch, lp_err, off_rows = 0, 0.0, 0.0
        for i, (ids, lps) in zip(my_seq_idx, got_seqs):
            s, t = seqs[i], trajs[i]
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            off_rows = max(off_rows, float(lps[~m].abs().max()), float(ids[~m].abs().max()))
            ids = torch.cat([torch.zeros(t.prompt_len, k, dtype=torch.long), ids[s.prompt_len:]])
            lps = torch.cat([torch.zeros(t.prompt_len, k), lps[s.prompt_len:]])
            sm = torch.tensor(t.loss_mask, dtype=torch.bool)
            # the same top-K set (with K = V the order of near-equal tail values may differ)
            id_mismatch += int((ids[sm].sort(-1).values != want[i][0][sm].sort(-1).values).any(-1).sum())
            lp_err = max(lp_err, float((lps[sm] - want[i][1][sm]).abs().max()))
            ids[~sm], lps[~sm] = -1, float("nan")       # poison: rows off the loss mask must never be read
            teacher[mine_idx.index(i)] = (ids, lps)
        res["teacher_id_mismatch"] = D.all_reduce_sum([id_mismatch])[0]
        err["teacher_lp_err"], err["teacher_off_rows"] = lp_err, off_rows

        # ---- term: beta x the top-K term alone through accumulate
        kl_graph = {i: reference_kl(ref, trajs[i], want[i]) for i in seqs}
        kl_ref = {i: v.detach() for i, v in kl_graph.items()}
        n_all = sum(sum(t.loss_mask) for t in trajs)             # the policy loss's token-mean normaliser
        masks = {i: torch.tensor(trajs[i].loss_mask, dtype=torch.bool) for i in seqs}
        ref.zero_grad(set_to_none=True)
        (sum(kl_graph[i][masks[i]].sum() for i in seqs) * BETA / n_all).backward()
        g_term_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}
        term = TopKTerm(mine, teacher, BETA, TEMP)
        sub = list(reversed(range(len(mine))))      # packed in another order: head_extra must map mb -> sub -> mine
        mbs, n_real = pack_equal([mine[j] for j in sub], BUDGET, term.per_token(sub))
        normaliser = D.all_reduce_sum([sum(count_normaliser(mb.tensors["loss_mask"]) for mb in mbs)])[0]
        assert normaliser == n_all, (normaliser, n_all)
        kls = []

        def term_only(mb, lp, ent, kl):
            kls.append(kl.detach().cpu())
            return term.add_loss((0.0 * lp.sum(), {}), mb, kl, normaliser, "token-mean")

        engine.train()
        accumulate(engine, mbs, term_only, temperature=TEMP, head_extra=lambda mb: term.head_extra(mb, sub))
        g_term = full_grads(engine)
        engine.optimizer.zero_grad()
        err["term_grad_rel_err"] = rel_err(g_term, g_term_ref)
        res["term_grad_norm"] = sum(float(g.double().pow(2).sum()) for g in g_term_ref.values()) ** 0.5
        kl_err = off_mask = full_err = 0.0
        for j, kl in zip(sub, unpack_to_sequences(mbs[:n_real], kls[:n_real], len(mine))):
            i = mine_idx[j]
            use = torch.tensor(trajs[i].loss_mask, dtype=torch.bool) & (i in seqs)
            off_mask = max(off_mask, float(kl[~use].abs().max()))
            if i in seqs:
                kl_err = max(kl_err, float((kl[use] - kl_ref[i][use]).abs().max()))
                if k == vocab:   # the top-K set is the vocabulary: the exact reverse KL
                    with torch.no_grad():
                        lp = logp_rows(ref, trajs[i].token_ids)
                        full = (lp.exp() * (lp - want_full[i])).sum(-1)
                    full_err = max(full_err, float((kl[use] - full[use]).abs().max()))
        err.update(term_kl_err=kl_err, term_off_mask=off_mask, full_kl_err=full_err)
        res["kl_ref_mean"] = sum(float(kl_ref[i][masks[i]].sum()) for i in seqs) / sum(int(masks[i].sum()) for i in seqs)

        # ---- update: ppo_update's gradient without the term, at beta 0, and at BETA
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            old = [logp_rows(ref, t.token_ids).gather(1, torch.tensor(t.token_ids)[:, None])[:, 0]
                   + 0.3 * torch.randn(len(t.token_ids), generator=g) for t in trajs]
        adv = [torch.full((len(t.token_ids),), (-1.0) ** i * (0.5 + 0.1 * i)) for i, t in enumerate(trajs)]
        algo = AlgoArgs(clip_low=0.2, clip_high=0.28, entropy_coef=0.0)
        metrics = {}
        for name, beta in (("off", None), ("zero", 0.0), ("beta", BETA)):
            d = None if beta is None else TopKTerm(mine, teacher, beta, TEMP)
            metrics[name], n_steps, n_skipped = ppo_update(
                engine, mine, [adv[i] for i in mine_idx], [old[i] for i in mine_idx], None, algo,
                temperature=TEMP, micro_token_budget=BUDGET, distill=d)
            assert n_steps == 1 and n_skipped == 0, (name, n_steps, n_skipped)
        g_off, g_zero, g_beta = grads[-3:]
        err["zero_vs_off_max_abs"] = max(float((g_zero[n] - g_off[n]).abs().max()) for n in g_off)
        res["off_grad_max_abs"] = max(float(g_off[n].abs().max()) for n in g_off)
        err["update_term_rel_err"] = rel_err({n: g_beta[n] - g_off[n] for n in g_off}, g_term_ref)
        res["update_metrics"] = {n: {k2: v for k2, v in m.items() if k2.startswith("distill/")} for n, m in metrics.items()}
        # sequential roles, 2 epochs x 2 mini-batches; the trajectories without a teacher play the proposer, so
        # some optimizer steps hold no covered token (and rank 1 of 2 only dummies). The weights never move,
        # so distill/kl, the mean over every update micro-batch, is still the reference's mean.
        roles = [dataclasses.replace(t, role="proposer") if i in NO_TEACHER else t for i, t in zip(mine_idx, mine)]
        algo = AlgoArgs(clip_low=0.2, clip_high=0.28, entropy_coef=0.0, update_mode="sequential", ppo_epochs=2,
                        ppo_mini_batches=2)
        m, n_steps, n_skipped = ppo_update(engine, roles, [adv[i] for i in mine_idx], [old[i] for i in mine_idx], None,
                                           algo, temperature=TEMP, micro_token_budget=BUDGET,
                                           distill=TopKTerm(roles, teacher, BETA, TEMP))
        res["sequential"] = {"optimizer_steps": n_steps, "skipped": n_skipped, "distill/kl": m["distill/kl"]}
        for key, v in err.items():
            res[key] = D.all_reduce_max(v)
        return res

    results = {str(k): phases(k) for k in ks}
    if rank == 0:
        out_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
