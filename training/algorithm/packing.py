"""Pack variable-length trajectories into one-row micro-batches under a token budget.

A micro-batch is a single row of concatenated sequences, with `position_ids`
restarting at 0 for each sequence and `cu_seqlens` marking the bounds, so no
compute is spent on padding. Attention must never cross sequences:

- GPU (flash_attention_2/3): transformers' varlen path, fed cu_seq_lens_q/k and
  max_length_q/k explicitly (docs/PLATFORM_NOTES.md, transformers flash-attn varlen). UNTESTED ON GPU in this repo.
- CPU, sdpa: `enable_varlen_sdpa(model)` (sequence_logprobs calls it) registers an
  sdpa variant that runs one causal SDPA call per sequence, fed the same cu_seq_lens
  kwargs: cost sum(L_i^2), not T^2.
- CPU, plain sdpa / eager: an explicit 4D block-diagonal causal mask, bool for sdpa
  and additive float for eager (correct, but attention costs T^2 per row).
We never rely on transformers' packed-sequence detection: it is silently skipped
when a KV cache exists (Llama/Qwen2 default to use_cache=True), and then sequences
attend to each other. `model_inputs` always sets use_cache=False as well, and
`verify_packed_attention` is a start-up check against separate runs.

ZeRO-3 forwards are collective: every rank must run the same number of
micro-batches. The flow for the trainer:

    plan  = plan_micro_batches(lengths, max_tokens)            # local count
    n     = global_max(len(plan), all_reduce_max)               # same on all ranks
    mbs   = pack_micro_batches(ids, max_tokens, per_token=..., min_micro_batches=n)
    mbs   = equalise_micro_batches(mbs, all_reduce_max)         # dummies where still short

A dummy micro-batch is one token with loss_mask 0: it runs the forward and
backward (so the collectives match) and contributes exactly zero loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from utils import dist as D

AllReduceMax = Callable[[int], int]
FLASH_IMPLS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn",
               "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor                 # (1, T) long
    position_ids: torch.Tensor              # (1, T) long, restarts at 0 per sequence
    cu_seqlens: torch.Tensor                # (S+1,) int32, sequence bounds in the row
    max_seqlen: int
    seq_indices: list[int]                  # index of each packed sequence in the caller's list
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)      # per token, (T,) each
    seq_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per sequence, (S,) each
    is_dummy: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a packed per-token tensor, (T, ...) or (1, T, ...), into one tensor per sequence."""
        if x.ndim >= 2 and x.shape[0] == 1 and x.shape[1] == self.num_tokens:
            x = x[0]
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"cannot unpack a tensor of {x.shape[0]} tokens from a micro-batch of {self.num_tokens}")
        return [] if self.is_dummy else list(torch.split(x, self.seq_lens))

    def to(self, device) -> "MicroBatch":
        mv = {k: v.to(device) for k, v in self.tensors.items()}
        sv = {k: v.to(device) for k, v in self.seq_tensors.items()}
        return MicroBatch(self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device),
                          self.max_seqlen, list(self.seq_indices), mv, sv, self.is_dummy)


# ----------------------------------------------------------------------------- planning

def plan_micro_batches(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Group sequence indices into bins of at most `max_tokens` tokens.

    First-fit-decreasing gives the bin count k (at most 11/9 OPT + 6/9 bins, Dosa 2007).
    We then rebalance into max(k, min_micro_batches) bins with longest-processing-time
    (largest first into the lightest bin), which evens out the bins' sizes and so the
    peak memory; if that ever breaks the budget we keep the FFD bins. Empty bins
    (fewer sequences than min_micro_batches) are dropped; equalise_micro_batches pads.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, over the micro-batch budget max_tokens={max_tokens}; "
                         f"raise max_tokens to at least the rollout's max total tokens ({len(too_long)} too long)")
    if any(n <= 0 for n in lengths):
        raise ValueError("every sequence needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    k = max(len(bins), min_micro_batches)
    if k > 0 and order:
        lpt: list[list[int]] = [[] for _ in range(k)]
        lpt_loads = [0] * k
        for i in order:
            b = min(range(k), key=lambda j: (lpt_loads[j], len(lpt[j]), j))
            lpt[b].append(i)
            lpt_loads[b] += lengths[i]
        if max(lpt_loads) <= max_tokens:
            bins = [b for b in lpt if b]
    return [sorted(b) for b in bins]


# ----------------------------------------------------------------------------- packing

def _as_1d(x, name: str, i: int, n: int) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim != 1 or t.shape[0] != n:
        raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected ({n},) like token_ids[{i}]")
    return t


def pack_micro_batches(
    token_ids: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    per_token: Mapping[str, Sequence] | None = None,
    per_seq: Mapping[str, Sequence] | None = None,
    min_micro_batches: int = 1,
) -> list[MicroBatch]:
    """Pack sequences into micro-batches of at most `max_tokens` tokens.

    token_ids: one id list (or 1-D tensor) per sequence.
    per_token: name -> one list/tensor per sequence, aligned to its token_ids (e.g.
      "loss_mask", "rollout_logprobs", "advantages", "old_logprobs"); packed like the ids.
      "loss_mask"[0] must be 0 for every sequence: the first token has no prediction.
    per_seq: name -> one scalar per sequence (e.g. "reward").
    """
    per_token = dict(per_token or {})
    per_seq = dict(per_seq or {})
    ids = [torch.as_tensor(t, dtype=torch.long) for t in token_ids]
    for name, vals in {**per_token, **per_seq}.items():
        if len(vals) != len(ids):
            raise ValueError(f"{name} has {len(vals)} entries for {len(ids)} sequences")
    fields = {k: [_as_1d(v[i], k, i, len(ids[i])) for i in range(len(ids))] for k, v in per_token.items()}
    if "loss_mask" in fields:
        bad = [i for i, m in enumerate(fields["loss_mask"]) if bool(m[0])]
        if bad:
            raise ValueError(f"loss_mask[0] is 1 for sequences {bad[:10]}: the first token of a sequence "
                             "has no prediction, so it cannot carry loss (it should be a prompt token)")
    plan = plan_micro_batches([len(t) for t in ids], max_tokens, min_micro_batches)
    out = []
    for bin_ in plan:
        lens = torch.tensor([len(ids[i]) for i in bin_])
        cu = torch.zeros(len(bin_) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        out.append(MicroBatch(
            input_ids=torch.cat([ids[i] for i in bin_])[None],
            position_ids=torch.cat([torch.arange(len(ids[i])) for i in bin_])[None],
            cu_seqlens=cu,
            max_seqlen=int(lens.max()),
            seq_indices=list(bin_),
            tensors={k: torch.cat([v[i] for i in bin_]) for k, v in fields.items()},
            seq_tensors={k: torch.as_tensor([per_seq[k][i] for i in bin_]) for k in per_seq},
        ))
    return out


def pack_trajectories(trajectories, max_tokens: int, *, per_token: Mapping[str, Sequence] | None = None,
                      min_micro_batches: int = 1) -> list[MicroBatch]:
    """Pack `inference.trajectory.Trajectory` objects: loss_mask, rollout_logprobs and reward come along.

    `per_token` adds fields computed by the trainer (e.g. "advantages", "old_logprobs").
    """
    fields = {"loss_mask": [t.loss_mask for t in trajectories],
              "rollout_logprobs": [torch.tensor(t.logprobs, dtype=torch.float32) for t in trajectories]}
    fields.update(per_token or {})
    return pack_micro_batches([t.token_ids for t in trajectories], max_tokens, per_token=fields,
                              per_seq={"reward": [float(t.reward) for t in trajectories]},
                              min_micro_batches=min_micro_batches)


def unpack_to_sequences(micro_batches: Sequence[MicroBatch], packed: Sequence[torch.Tensor],
                        num_sequences: int) -> list[torch.Tensor]:
    """Scatter per-micro-batch packed outputs back to the caller's sequence order."""
    if len(packed) != len(micro_batches):
        raise ValueError(f"{len(packed)} outputs for {len(micro_batches)} micro-batches")
    result: list[torch.Tensor | None] = [None] * num_sequences
    for mb, x in zip(micro_batches, packed):
        for i, piece in zip(mb.seq_indices, mb.unpack(x)):
            result[i] = piece
    missing = [i for i, r in enumerate(result) if r is None]
    if missing:
        raise ValueError(f"sequences {missing[:10]} are in no micro-batch")
    return result  # type: ignore[return-value]


# ----------------------------------------------------------------------------- equal counts across ranks

def dummy_micro_batch(per_token_keys: Sequence[str] = ("loss_mask",), per_seq_keys: Sequence[str] = (),
                      pad_id: int = 0) -> MicroBatch:
    """One pad token, loss_mask 0: runs the model (matching collectives), adds zero loss and gradient."""
    keys = set(per_token_keys) | {"loss_mask"}
    return MicroBatch(
        input_ids=torch.full((1, 1), pad_id, dtype=torch.long), position_ids=torch.zeros(1, 1, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, seq_indices=[],
        tensors={k: torch.zeros(1, dtype=torch.long if k == "loss_mask" else torch.float32) for k in sorted(keys)},
        seq_tensors={k: torch.zeros(0) for k in per_seq_keys}, is_dummy=True)


def global_max(value: int, all_reduce_max: AllReduceMax | None = None) -> int:
    """Max of `value` over ranks: the callable if given, else utils.dist (a no-op without a process group)."""
    if all_reduce_max is not None:
        return int(all_reduce_max(int(value)))
    return int(D.all_reduce_max(int(value)))


def equalise_micro_batches(micro_batches: list[MicroBatch], all_reduce_max: AllReduceMax | None = None,
                           per_token_keys: Sequence[str] | None = None, pad_id: int = 0) -> list[MicroBatch]:
    """Append dummy micro-batches until every rank holds the same number (the global max).

    Collective: every rank must call it. The dummies carry the same per-token keys
    as the local micro-batches (or `per_token_keys` when this rank has none).
    """
    n = global_max(len(micro_batches), all_reduce_max)
    if micro_batches:
        keys, seq_keys = list(micro_batches[0].tensors), list(micro_batches[0].seq_tensors)
    else:
        keys, seq_keys = list(per_token_keys or ("loss_mask",)), []
    pad = [dummy_micro_batch(keys, seq_keys, pad_id) for _ in range(n - len(micro_batches))]
    return list(micro_batches) + pad


# ----------------------------------------------------------------------------- attention inputs

def block_causal_mask(cu_seqlens: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None,
                      device=None) -> torch.Tensor:
    """(1, 1, T, T) mask: token i sees token j iff same sequence and j <= i.

    dtype None gives bool (True = attend; for sdpa). A float dtype gives the additive
    form (0 / finfo.min) that eager attention needs: eager *adds* the mask, so a
    bool mask there would be silently wrong.
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens).to(device)
    if seg.numel() != num_tokens:
        raise ValueError(f"cu_seqlens covers {seg.numel()} tokens, the row has {num_tokens}")
    idx = torch.arange(num_tokens, device=device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    if dtype is None:
        return allowed[None, None]
    mask = torch.zeros(num_tokens, num_tokens, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


VARLEN_SDPA = "ssp_varlen_sdpa"


def _varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA, one causal call per packed sequence when cu_seq_lens_q is given (plain sdpa otherwise).

    The CPU counterpart of flash-attn varlen: cost sum(L_i^2) instead of the T^2 of a
    block-diagonal mask over the whole row, and no (T, T) mask. query (B, heads, T, d),
    key/value (B, kv_heads, T, d); returns (B, T, heads, d) like transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and window < int(kwargs.get("max_length_q") or query.shape[2]):
        raise NotImplementedError(f"{VARLEN_SDPA} does not apply sliding-window attention (window {window}); "
                                  "use flash attention or a model without sliding windows")
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"{VARLEN_SDPA} with cu_seq_lens needs one packed row and no KV cache, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    extra = {}
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        if use_gqa_in_sdpa(None, key, value):
            extra["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bounds = cu.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, scale=scaling, is_causal=True, **extra)
        for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def enable_varlen_sdpa(model: torch.nn.Module) -> str:
    """Switch a model loaded with attn_implementation="sdpa" to the varlen SDPA above; returns the implementation.

    Permanent on purpose: under gradient checkpointing the forward is recomputed in
    backward, so the implementation must not change between the two. Calls without
    cu_seq_lens (generation, padded batches) behave exactly as sdpa: same function,
    same mask builder. Other implementations are left alone.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    if model.config._attn_implementation == "sdpa":
        model.config._attn_implementation = VARLEN_SDPA
    return model.config._attn_implementation


def model_inputs(mb: MicroBatch, attn_implementation: str, dtype: torch.dtype = torch.float32) -> dict:
    """Keyword arguments for an HF decoder forward on one packed row, attention kept within sequences."""
    base = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
    if attn_implementation == VARLEN_SDPA or attn_implementation in FLASH_IMPLS or "flash" in attn_implementation:
        # Flash branch UNTESTED ON GPU: transformers' varlen path with explicit bounds.
        cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.int32)
        return {**base, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": mb.max_seqlen, "max_length_k": mb.max_seqlen}
    if attn_implementation == "sdpa":
        return {**base, "attention_mask": block_causal_mask(mb.cu_seqlens, mb.num_tokens, None, mb.input_ids.device)}
    if attn_implementation == "eager":
        return {**base, "attention_mask": block_causal_mask(mb.cu_seqlens, mb.num_tokens, dtype, mb.input_ids.device)}
    raise ValueError(f"packed training supports sdpa, eager and flash attention, not {attn_implementation!r}; "
                     "load the model with attn_implementation='sdpa' (CPU) or 'flash_attention_2' (GPU)")


def verify_packed_attention(model: torch.nn.Module, inputs_fn: Callable = model_inputs, atol: float = 1e-4,
                            vocab_limit: int = 100) -> float:
    """A guard for packed attention: packed hidden states must equal separate runs, or raise. Not yet called at
    a run's start (tests/training/test_packing.py runs it): on SmolLM2-135M fp32 it measured 4.4e-5 against
    max |h| 57 (so the absolute atol is near its edge on a real model), bf16 0.0, and a leak 30.

    Runs the model's backbone on two short sequences packed in one row and on each
    alone (three tiny forwards, no grad, eval mode for the call) and compares. It
    catches the silent cross-sequence attention (docs/PLATFORM_NOTES.md, transformers packed sequences) if a
    transformers upgrade changes how masks or caches are handled. Under ZeRO-3 the
    forwards are collective: call it on every rank. Returns the max difference.
    """
    backbone = model.base_model
    impl = enable_varlen_sdpa(model)          # check the path training takes
    param = next(backbone.parameters())
    g = torch.Generator().manual_seed(0)
    vocab = min(vocab_limit, model.config.vocab_size)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 7)]
    mb = pack_micro_batches(seqs, 12)[0].to(param.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = backbone(**inputs_fn(mb, impl, param.dtype)).last_hidden_state[0].float()
            alone = torch.cat([backbone(input_ids=mb.input_ids[:, s:e], use_cache=False).last_hidden_state[0]
                               for s, e in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())]).float()
    finally:
        model.train(was_training)
    diff = float((packed - alone).abs().max())
    if not diff <= atol:
        raise RuntimeError(f"packed attention leaks across sequences with attn_implementation={impl!r}: max hidden "
                           f"difference {diff:.3g} > {atol}; check training.algorithm.packing.model_inputs against this "
                           "transformers version (see docs/PLATFORM_NOTES.md, transformers packed sequences)")
    return diff
