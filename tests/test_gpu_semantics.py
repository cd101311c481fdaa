"""CPU checks of the semantics of GPU-only branches (docs/gpu.md, "GPU-only branches").

Each test runs the repo's GPU branch on CPU with only the CUDA-only piece swapped for a CPU
equivalent, and checks it against the CPU path:
- flash-attn varlen: transformers' real flash_attention_2 dispatch, fed model_inputs' cu_seq_lens /
  max_length kwargs, with flash_attn_varlen_func replaced by a per-sequence SDPA reference;
- engine_builder._attn_impl's choice on a CUDA machine, and the pinned-memory flags of the offload configs;
- utils.dist.gather_to_main under a (faked) NCCL group: no CPU tensor may reach the collective;
- faiss-gpu: retriever._to_gpus without GPU support refused clearly (its sharding onto fake GPUs, real CPU faiss
  shards, is tests/retrieval/test_faiss_gpus.py's).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from training.algorithm.packing import FLASH_IMPLS, block_causal_mask, model_inputs, pack_micro_batches

VOCAB = 211


def _tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


def _sequences(seed: int = 0, lengths=(5, 17, 3, 11, 9)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# ----------------------------------------------------------------------------- flash-attn varlen

def test_flash_kwargs_describe_the_same_sequences_as_the_block_mask():
    """model_inputs' flash branch: cu_seq_lens_q/k (int32, equal), max_length_q/k (the longest sequence)
    must rebuild exactly the block-diagonal causal mask of the sdpa branch, for every flash name."""
    mbs = pack_micro_batches(_sequences(), 24)
    assert len(mbs) >= 2 and any(len(mb.seq_indices) >= 2 for mb in mbs)
    for impl in FLASH_IMPLS:
        for mb in mbs:
            kw = model_inputs(mb, impl)
            cu_q, cu_k = kw["cu_seq_lens_q"], kw["cu_seq_lens_k"]
            assert "attention_mask" not in kw and kw["use_cache"] is False
            assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)     # flash-attn wants int32 bounds
            assert int(cu_q[0]) == 0 and int(cu_q[-1]) == mb.num_tokens
            lens = cu_q.diff()
            assert bool((lens > 0).all()) and kw["max_length_q"] == kw["max_length_k"] == int(lens.max())
            assert lens.tolist() == mb.seq_lens
            # position_ids restart at each bound (transformers' own packed detection agrees)
            starts = torch.cat([torch.arange(int(n)) for n in lens])
            assert torch.equal(kw["position_ids"][0], starts)
            # the mask these bounds mean == the sdpa branch's explicit mask
            seg = torch.repeat_interleave(torch.arange(len(lens)), lens.long())
            idx = torch.arange(mb.num_tokens)
            from_cu = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
            assert torch.equal(from_cu[None, None], model_inputs(mb, "sdpa")["attention_mask"])
            assert torch.equal(from_cu[None, None], block_causal_mask(mb.cu_seqlens, mb.num_tokens))


class _ReferenceVarlen:
    """flash_attn_varlen_func's contract in torch: (total, heads, d) q and (total, kv_heads, d) k/v,
    one causal attention per [cu[i], cu[i+1]) segment. Records what the flash glue passed."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, block_table=None):
        lens = cu_seqlens_q.diff()
        self.calls.append(dict(dtype=cu_seqlens_q.dtype, same_k=torch.equal(cu_seqlens_q, cu_seqlens_k),
                               total=q.shape[0], last=int(cu_seqlens_q[-1]), causal=causal,
                               max_ok=int(max_seqlen_q) == int(lens.max()) == int(max_seqlen_k)))
        bounds = cu_seqlens_q.tolist()
        outs = [torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), dropout_p=dropout_p,
            scale=softmax_scale, is_causal=causal, enable_gqa=True).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs)


def _reference_dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func's contract in torch: (B, T, heads, d) in and out (one unpacked sequence per row)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, scale=softmax_scale,
        is_causal=causal, enable_gqa=True).transpose(1, 2)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """transformers' flash_attention_2 path with the CUDA kernels swapped for torch references."""
    import transformers.modeling_flash_attention_utils as mfa

    ref = _ReferenceVarlen()
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        if hasattr(mfa, name):                                      # the set differs between transformers 5.x
            monkeypatch.setattr(mfa, name, getattr(mfa, name))      # restored after the test
    monkeypatch.setattr(mfa, "_lazy_imports", lambda impl, *a, **k: (_reference_dense, ref, None, mfa._pad_input, mfa._unpad_input))
    return ref


@pytest.mark.timeout(60)
def test_flash_attention_2_glue_fed_model_inputs_matches_separate_runs(flash_on_cpu):
    """The packed forward + backward through transformers' flash_attention_2 dispatch (the GPU path:
    model_inputs' FLASH branch -> _flash_attention_forward -> flash_attn_varlen_func) equals the
    per-sequence SDPA path in log-probs, entropy and gradients."""
    from training.algorithm.logprobs import sequence_logprobs

    seqs = _sequences(1)
    mb = pack_micro_batches(seqs, 64)[0]
    assert len(mb.seq_indices) == len(seqs)
    flash, ref = _tiny_qwen2(), _tiny_qwen2()
    flash.config._attn_implementation = "flash_attention_2"
    out = {}
    for name, model in (("flash", flash), ("sdpa", ref)):
        lp, ent = sequence_logprobs(model, mb, 0.8, compute_entropy=True, only_masked=False)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[name] = (lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert flash.config._attn_implementation == "flash_attention_2"
    assert ref.config._attn_implementation == "ssp_varlen_sdpa"
    calls = flash_on_cpu.calls
    assert len(calls) == flash.config.num_hidden_layers              # one varlen call per layer
    assert all(c["dtype"] == torch.int32 and c["same_k"] and c["total"] == c["last"] == mb.num_tokens
               and c["causal"] and c["max_ok"] for c in calls), calls
    torch.testing.assert_close(out["flash"][0], out["sdpa"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["flash"][1], out["sdpa"][1], atol=1e-5, rtol=0)
    worst = max(float((g - out["sdpa"][2][n]).abs().max()) for n, g in out["flash"][2].items())
    assert worst < 1e-5, worst


@pytest.mark.timeout(60)
def test_flash_glue_check_catches_bounds_that_merge_sequences(flash_on_cpu):
    """Negative control: the same glue fed one bound over the whole row attends across sequences."""
    seqs = _sequences(2, (6, 8))
    mb = pack_micro_batches(seqs, 64)[0]
    model = _tiny_qwen2()
    model.config._attn_implementation = "flash_attention_2"
    with torch.no_grad():
        sep = torch.cat([model.model(seqs[i][None], use_cache=False).last_hidden_state[0] for i in mb.seq_indices])
        kw = model_inputs(mb, "flash_attention_2")
        good = model.model(**kw).last_hidden_state[0]
        whole = torch.tensor([0, mb.num_tokens], dtype=torch.int32)
        bad = model.model(**{**kw, "cu_seq_lens_q": whole, "cu_seq_lens_k": whole, "max_length_q": mb.num_tokens,
                             "max_length_k": mb.num_tokens}).last_hidden_state[0]
    assert float((good - sep).abs().max()) < 1e-5
    assert float((bad - sep).abs().max()) > 1e-3


def test_attn_impl_picks_flash_on_cuda_only_when_installed(monkeypatch):
    """engine_builder._attn_impl on a CUDA machine: flash_attention_2 with flash_attn importable, sdpa
    without; an explicit choice passes through. Whatever it picks, model_inputs has a branch for it."""
    from training.settings.config import Config
    from training.engine.engine_builder import _attn_impl

    cfg = Config()
    assert cfg.model.attn_implementation == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert _attn_impl(cfg) == "flash_attention_2"
    monkeypatch.setitem(sys.modules, "flash_attn", None)             # import flash_attn -> ImportError
    assert _attn_impl(cfg) == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(sys.modules, "flash_attn")
    assert _attn_impl(cfg) == "sdpa"
    cfg.model.attn_implementation = "eager"
    assert _attn_impl(cfg) == "eager"
    mb = pack_micro_batches(_sequences(), 64)[0]
    assert "cu_seq_lens_q" in model_inputs(mb, "flash_attention_2")
    assert "attention_mask" in model_inputs(mb, "sdpa")


# ----------------------------------------------------------------------------- pinned memory in offload

def test_offload_configs_pin_host_memory_on_cuda_only(monkeypatch):
    """build_ds_config: offload_param / offload_optimizer pin host memory with CUDA (async H2D copies)
    and not without; DeepSpeed's ZeRO config parser accepts both."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from training.settings.config import Config
    from training.engine.engine_builder import build_ds_config

    cfg = Config()
    cfg.deepspeed.zero_stage, cfg.deepspeed.offload_param, cfg.deepspeed.offload_optimizer = 3, True, True
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        zero = build_ds_config(cfg)["zero_optimization"]
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": cuda}
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": cuda}
        parsed = DeepSpeedZeroConfig(**zero)
        assert parsed.offload_param.pin_memory is cuda and parsed.offload_optimizer.pin_memory is cuda
        assert "offload_optimizer" not in build_ds_config(cfg, train=False)["zero_optimization"]


# ----------------------------------------------------------------------------- NCCL gather (HF export)

def test_gather_to_main_under_nccl_sends_no_cpu_tensor(monkeypatch):
    """gather_to_main (the HF export's per-parameter gather; offloaded partitions live on the CPU)
    under a faked NCCL group of 2: the CPU tensor must be moved to CUDA before dist.gather. On a
    CPU-only torch the move itself raises a CUDA error, which is the point: gloo never sees it."""
    import torch.distributed as dist

    from utils import dist as D

    seen: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "gather", lambda t, out=None, dst=0, group=None, async_op=False: seen.append(t.device.type))
    part = torch.arange(12, dtype=torch.float32).view(torch.uint8)      # bytes, as hf_export._gather_to_main sends
    try:
        out = D.gather_to_main(part)
    except (AssertionError, RuntimeError) as e:                           # "Torch not compiled with CUDA enabled"
        assert "CUDA" in str(e) or "cuda" in str(e), e
        out = None
    assert "cpu" not in seen
    if torch.cuda.is_available():
        assert seen == ["cuda"] and out is not None and all(o.device.type == "cuda" for o in out)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # gloo: the CPU tensor goes as is
    seen.clear()
    D.gather_to_main(part)
    assert seen == ["cpu"]


# ----------------------------------------------------------------------------- faiss-gpu

def test_faiss_gpu_without_gpu_support_is_refused_clearly():
    import faiss

    from retrieval.retriever import _to_gpus

    if faiss.get_num_gpus() > 0:
        pytest.skip("this faiss sees a GPU")
    with pytest.raises(RuntimeError, match="install faiss-gpu"):
        _to_gpus(faiss, faiss.IndexFlatIP(8), {"index_type": "flat"})


# ----------------------------------------------------------------------------- on a GPU only (skipped here)

@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_packed_logprobs_take_varlen_sdpa_and_triton_and_match_unpacked(dtype, tol):
    """The CUDA path of sequence_logprobs without flash-attn: per-sequence SDPA for the packed row and,
    since the hidden states are on CUDA, the compiled Triton head (use_triton_kernel), forward and backward,
    against a plain per-sequence forward with a full log_softmax."""
    from training.algorithm.logprobs import use_triton_kernel, sequence_logprobs

    seqs = _sequences(3, (9, 33, 4, 20))
    mb = pack_micro_batches(seqs, 128)[0].to("cuda")
    model = _tiny_qwen2().to("cuda", dtype)
    assert use_triton_kernel(torch.zeros(1, device="cuda"))
    lp, _ = sequence_logprobs(model, mb, 0.9, only_masked=False)
    lp.sum().backward()
    got_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.config._attn_implementation = "sdpa"
    want = []
    for i in mb.seq_indices:
        x = seqs[i].to("cuda")
        logp = torch.log_softmax(model(x[None], use_cache=False).logits[0].float() / 0.9, -1)
        want.append(torch.cat([torch.zeros(1, device="cuda"), logp[:-1].gather(1, x[1:, None]).squeeze(1)]))
    want = torch.cat(want)
    want.sum().backward()
    assert float((lp - want).abs().max()) < tol
    worst = max(float((g - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp(min=1))
                for (n, g), p in zip(got_grads.items(), model.parameters()))
    assert worst < tol * 10, worst


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_hf_engine_on_cuda_generates_what_it_generates_on_cpu():
    """HFEngine's device placement: the same fp32 model on CUDA gives the CPU's greedy tokens and, with
    per-prompt seeds (sampling draws on a CPU generator), the same sampled tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from inference.engine_api import SamplingConfig
    from inference.hf_engine import HFEngine

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), eos_token="t1",
                                  pad_token="t0")
    prompts = [s.tolist() for s in _sequences(4, (5, 12, 8))]
    out = {}
    for device in ("cpu", "cuda"):
        engine = HFEngine(_tiny_qwen2().to(device), tokenizer=tok, batch_size=2)
        assert engine.device.type == device
        greedy = engine.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=12, min_tokens=12))
        sampled = engine.generate(prompts, [SamplingConfig(temperature=1.0, max_tokens=12, min_tokens=12, seed=s)
                                            for s in (1, 2, 3)])
        out[device] = ([o.token_ids for o in greedy], [o.token_ids for o in sampled],
                       [o.logprobs for o in greedy])
    assert out["cuda"][0] == out["cpu"][0] and out["cuda"][1] == out["cpu"][1]
    assert max(abs(a - b) for x, y in zip(out["cuda"][2], out["cpu"][2]) for a, b in zip(x, y)) < 1e-3
