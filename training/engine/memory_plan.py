"""Memory plan: will a launch fit? A per-GPU estimate of both phases of a step, from the resolved
Config and the model's config.json, computed without a GPU (`train.py --dry_run` prints it;
bench/memory_plan.py tabulates it for every scripts/train_*.sh). DeepSpeed is imported lazily,
only to put its own estimator beside ours.

Symbols: N = world size (ZeRO-3 partitions over every rank), P = parameters, Pt = trainable
parameters (--train_top_layers), b = bytes per value of --dtype (bf16 2, fp32 4), T =
--micro_token_budget, h / I / kv = hidden / intermediate / key-value width, L_t = trained layers.

train phase (vLLM asleep: ~0 of it on the GPU at either sleep level)
  params       b*P/N         the ZeRO-3 partition (host RAM with --offload_param)
  grads        b*Pt/N        DeepSpeed's grad_partitions_flat_buffer, in the model dtype
  optimizer    (4+8)*Pt/N    fp32 master (bf16 only: fp32 params are their own master) + Adam m, v
               grads and optimizer go to host RAM with --offload_optimizer. All trainable at bf16:
               16 B/param, the count of the ZeRO paper and of stage3.py's allocations.
  live gathers a module bigger than stage3_max_live_parameters is gathered whole (b*module), and its
               full gradient lives until its reduce-scatter (b*module), + prefetch and reduce buckets
  reference    b*P/N when --kl_coef > 0 and not --ref_offload (params only: no grads, no optimizer)
  critic       a gae role's PPO critic (training/algorithm/critic.py): its own partitions, b*Pc/N params, b*Pct/N grads
               and (4+8)*Pct/N optimizer (host RAM with --critic_offload_param / --critic_offload_optimizer);
               Pc = the actor's P without an untied lm_head, plus the value head (h + 1). Its forward and
               backward run after the actor's, not beside it, and its activations are the actor's less the
               log-prob head: the working set below covers both.
  activations  Llama-style block, flash/varlen attention (no T^2 term), saved for backward per token
               and layer: 10h + 4kv + 4I values (2 RMSNorms: fp32 upcast + output = 3h each; q, k before
               and after RoPE and rotate_half, v, attention output = 4h + 4kv; gate, up, silu, product =
               4I). Without checkpointing: L_t*T*that*b. With it: each trained layer keeps only its
               input (L_t*T*h*b) and one layer's full set is rebuilt in its backward. Frozen layers
               below the trained ones run with no graph. Plus the final hidden state and its gradient.
  log-prob head training/logprobs*.py: one (chunk, V) buffer at b, chunk = auto_chunk_size(V, T);
               when the lm_head trains, dW accumulates in fp32 (4Vh) and each chunk's b-dtype
               product is cast to fp32 before the add: (8+b)*V*h at bf16, 4Vh at fp32 (addmm_).
  backward     the head's moment (gathered lm_head + its grad + the head buffers) and a layer's
               moment (its recomputed activations + gathered modules) come one after the other: the
               working set is saved activations + buckets + the larger of the two. On an H100 this came
               out 5-8% above torch's measured forward+backward peak (bench/memory_plan_gpu.py).
  step         without optimizer offload DeepSpeed makes an fp32 copy of one sub-group's gradient
               (sub_group_size 1e9) and torch AdamW's foreach sqrt one more buffer: 8*min(Pt/N, 1e9).
               It comes after backward, so the peak takes max(working set, step), not their sum.
  runtime      2 GiB assumed: CUDA context, NCCL buffers, cuBLAS workspaces, vLLM's sleep residue.
generate phase
  vLLM         --gpu_memory_utilization x the GPU, in all (vLLM sizes itself to that fraction of the
               whole device): its weights b*P/tp and, in the rest less ~2 GiB assumed for its
               activations and CUDA graphs, the KV cache (2*layers*kv*b/tp bytes per token).
  resident     what training leaves on the GPU while vLLM is awake: param, grad and optimizer
               partitions (unless offloaded) and the reference partition.
--rollout_engine hf: the HF copy (b*P, never asleep) is resident in both phases, and generation
               adds a dense KV cache of 64 sequences at --max_model_len in place of vLLM's share.
retriever      --retriever_gpu_gb: what a retrieval server on the same GPUs holds (its FAISS shard,
               scratch pool, encoder), added to both phases: it never sleeps.
The numbers are estimates for planning, not measurements: fragmentation can add 5-10%.

checkpoint disk (`checkpoint_disk`; all ranks together, on the filesystem of --output_dir)
  ZeRO-3 optimizer  12*Pt   each rank's {bf16_,}zero_pp_rank_{r}_mp_rank_00_optim_states.pt holds its
                    partition of the fp32 master and of Adam's exp_avg and exp_avg_sq (stage3.py
                    _rigid_state_dict: fp32_flat_groups + the optimizer's state). At --dtype fp32 too:
                    stage 3 keeps an fp32 flat copy either way. The b-byte partitions of trainable
                    weights are not written (loading restores them from the fp32 master).
  frozen weights    b*(P-Pt) each rank's zero_pp_rank_{r}_mp_rank_00_model_states.pt carries its
                    partition of every weight outside the optimizer (frozen_param_fragments); the
                    trainable ones appear there as empty placeholders (~12 KB a rank all told)
  HF export         b*P (tied weights once) + tokenizer and config files, with --export_hf
  trainer state     trainer_rank{r}.pt: RNG states, cursors, guards (~14 KB) + the rank's question pool
  Checked against real saves on CPU (2 ranks, a 6.6M-parameter Llama, tests/training/test_checkpoint_disk.py):
  bf16 all trained, optimizer files 79,052,170 B vs 12*Pt = 79,044,096 (+8 KB of pickle), HF export
  16,700,678 vs 16,698,485; fp32 --train_top_layers 1, optimizer 1,782,054 vs 1,774,080, frozen
  25,786,122 vs 25,756,672 (+29 KB: placeholders, shapes, ds_config). The whole save came out 0.3% and
  0.5% under the formula, the margin being the per-rank allowance; the test holds each term to 0.1%
  plus a few KB per file and the whole to [measured, measured * 1.02]. Rotation deletes the oldest
  checkpoint after the newest is complete, so --max_ckpts N keeps N saves and holds N + 1 while one
  is being written.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.settings.config import needs_critic, needs_reference

GiB = 1 << 30
RUNTIME_OVERHEAD = 2 * GiB     # CUDA context + NCCL + cuBLAS workspaces + vLLM's sleep residue (assumed)
VLLM_NON_KV = 2 * GiB          # vLLM's profiled activations and CUDA graphs, inside its share (assumed)
SUB_GROUP_SIZE = 10**9         # DeepSpeed's default zero_optimization.sub_group_size (build_ds_config keeps it)
HF_BATCH = 64                  # prompts per HFEngine.generate chunk, as training/engine/setup.py builds it
ASSUMED_WORLD = 8              # the per-size scripts are sized for one 8-GPU node
# checkpoint disk: the small terms (allowances, not measured per model)
HF_EXTRAS_ASSUMED = 16 * 10**6  # tokenizer + config files of a model not on this machine (Qwen2.5's are ~11 MB)
RANK_STATE_BYTES = 64 * 1024   # per rank: trainer_rank{r}.pt without the pool (~14 KB) + DeepSpeed's
                               # model-states file of a fully trained model (~12 KB), with room to spare
POOL_ROW_BYTES = 1024          # per question kept in a rank's pool (question, answers, step), an allowance
HF_EXTRA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                  "chat_template.jinja", "chat_template.json")

# The architectures of the per-size scripts, for a hub id that is not on this machine (values of
# each model's config.json; the -Instruct variants share their base's). Keys: the id's last part,
# lower case, without "-instruct".
ARCHS = {
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
}


def sleep_level(cfg) -> int:
    """vLLM's sleep level while training. Level 1 keeps vLLM's weights in host RAM, so with
    --train_top_layers the frozen layers never need re-sending; level 2 discards them (cheaper on
    host RAM), which is right when every weight is re-sent after each step anyway."""
    return 1 if cfg.model.train_top_layers > 0 else 2


def load_arch(model_path: str) -> tuple[dict, str]:
    """(the model's config.json as a dict, where it came from)."""
    cfg_file = Path(model_path) / "config.json"
    if cfg_file.is_file():
        return json.loads(cfg_file.read_text()), f"{cfg_file}"
    key = model_path.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
    if key in ARCHS:
        return dict(ARCHS[key]), "the built-in table (no config.json at --model_path on this machine)"
    raise LookupError(f"no config.json at --model_path {model_path} and no built-in entry for it "
                      f"(known: {', '.join(sorted(ARCHS))})")


def count_params(arch: dict) -> dict:
    """Parameter counts of a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3) from its config."""
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if k not in arch:
            raise ValueError(f"config.json has no {k}: the memory plan knows Llama-style decoders only")
    h, i, nh = arch["hidden_size"], arch["intermediate_size"], arch["num_attention_heads"]
    nkv = arch.get("num_key_value_heads") or nh
    hd = arch.get("head_dim") or h // nh
    mt = arch.get("model_type", "llama")
    qkv_bias = mt == "qwen2" or bool(arch.get("attention_bias"))   # Qwen2 hard-codes q/k/v biases
    o_bias = mt != "qwen2" and bool(arch.get("attention_bias"))
    mlp_bias = bool(arch.get("mlp_bias"))
    q, kv = nh * hd, nkv * hd
    mods = {"q": h * q + qkv_bias * q, "k": h * kv + qkv_bias * kv, "v": h * kv + qkv_bias * kv,
            "o": q * h + o_bias * h, "gate": h * i + mlp_bias * i, "up": h * i + mlp_bias * i,
            "down": i * h + mlp_bias * h}
    layer = sum(mods.values()) + 2 * h + (2 * hd if mt == "qwen3" else 0)   # + norms (Qwen3: q/k norms)
    v = arch["vocab_size"]
    tied = bool(arch.get("tie_word_embeddings", mt != "llama" and mt != "qwen2" and mt != "qwen3"))
    embed, head = v * h, (0 if tied else v * h)
    n_layers = arch["num_hidden_layers"]
    return dict(total=embed + head + n_layers * layer + h, embed=embed, head=head, layer=layer,
                layers=n_layers, largest=max(v * h, *mods.values()), largest_in_layer=max(mods.values()),
                tied=tied, hidden=h, intermediate=i, kv_width=kv, head_dim=hd, kv_heads=nkv, vocab=v)


def trainable_params(counts: dict, top_layers: int) -> int:
    """As training.engine.engine_builder.freeze_lower_layers: the top layers and the final norm, or all."""
    if top_layers <= 0:
        return counts["total"]
    return min(top_layers, counts["layers"]) * counts["layer"] + counts["hidden"]


def hf_extra_bytes(model_path: str) -> tuple[int, str]:
    """(bytes of the tokenizer and config files an HF export copies, where the figure comes from)."""
    folder = Path(model_path)
    if (folder / "config.json").is_file():
        return sum((folder / f).stat().st_size for f in HF_EXTRA_FILES if (folder / f).is_file()), "measured"
    return HF_EXTRAS_ASSUMED, "assumed"


def saves_in_run(total_steps: int, save_every: int) -> int:
    """How many checkpoints a run from step 0 writes: every --save_every steps, and at the end."""
    if total_steps <= 0:
        return 0
    if save_every <= 0:
        return 1
    return total_steps // save_every + (1 if total_steps % save_every else 0)


def critic_params(cfg, counts: dict) -> tuple[int, int]:
    """(Pc, Pct): the critic's parameters (the decoder of --critic_model_path or the actor's, without an
    untied lm_head, plus veRL's value head h + 1) and the trainable ones (--critic_train_top_layers + head);
    (0, 0) when no role uses gae."""
    if not needs_critic(cfg):
        return 0, 0
    if cfg.critic.critic_model_path and cfg.critic.critic_model_path != cfg.model.model_path:
        counts = count_params(load_arch(cfg.critic.critic_model_path)[0])
    head = counts["hidden"] + 1
    pc = counts["total"] - (0 if counts["tied"] else counts["vocab"] * counts["hidden"]) + head
    top = cfg.critic.critic_train_top_layers
    return pc, (pc if top <= 0 else trainable_params(counts, top) + head)


def checkpoint_disk(cfg, world: int, counts: dict | None = None) -> dict:
    """Bytes one checkpoint takes on disk, all ranks together, and what --max_ckpts keeps (module
    docstring: checkpoint disk). ZeRO stage 3; at stages 0-2 DeepSpeed also writes the whole
    module from rank 0 (b*P more), which is added but was not measured."""
    if counts is None:
        counts = count_params(load_arch(cfg.model.model_path)[0])
    m, ck = cfg.model, cfg.checkpointing
    b = 2 if m.dtype == "bf16" else 4
    p = counts["total"]
    pt = trainable_params(counts, m.train_top_layers)
    optimizer = 12 * pt                               # fp32 master + exp_avg + exp_avg_sq, all partitions
    frozen = b * (p - pt)                             # frozen_param_fragments in the model-states files
    module = b * p if cfg.deepspeed.zero_stage < 3 else 0
    extras, extras_src = hf_extra_bytes(m.model_path)
    hf = b * p + extras if ck.export_hf else 0
    ranks = world * (RANK_STATE_BYTES + POOL_ROW_BYTES * cfg.selfplay.pool_size * cfg.selfplay.use_pool)
    pc, pct = critic_params(cfg, counts)             # the critic's tag: its optimizer and frozen weights
    critic = 12 * pct + b * (pc - pct) + (b * pc + extras) * (pc > 0 and cfg.critic.export_critic)
    one = optimizer + frozen + module + hf + ranks + critic
    n = saves_in_run(cfg.optimisation.total_steps, ck.save_every)
    kept = n if ck.max_ckpts <= 0 else min(ck.max_ckpts, n)
    during = min(kept + 1, n)                         # the newest is complete before the oldest goes
    return dict(optimizer=optimizer, frozen_params=frozen, module=module, hf_export=hf, hf_extras=extras, critic=critic,
                hf_extras_source=extras_src, rank_states=ranks, one_save=one, saves_in_run=n, max_ckpts=ck.max_ckpts,
                kept=kept, kept_bytes=kept * one, during_save=during, during_save_bytes=during * one)


def format_disk(d: dict) -> str:
    """The dry run's disk line (GB = 10^9 bytes, all ranks together)."""
    gb = 1e9
    keep = (f"--max_ckpts {d['max_ckpts']} kept" if d["max_ckpts"] > 0 else "--max_ckpts 0: all kept")
    parts = [f"ZeRO-3 fp32 master + Adam m, v {d['optimizer'] / gb:.2f}"]
    if d["frozen_params"]:
        parts.append(f"frozen weights {d['frozen_params'] / gb:.2f}")
    if d["module"]:
        parts.append(f"whole module (ZeRO stage < 3) {d['module'] / gb:.2f}")
    if d["hf_export"]:
        parts.append(f"HF export {d['hf_export'] / gb:.2f}")
    if d.get("critic"):
        parts.append(f"critic (its optimizer, frozen weights, --export_critic) {d['critic'] / gb:.2f}")
    parts.append(f"trainer states {d['rank_states'] / gb:.3f}")
    return (f"disk: one save {d['one_save'] / gb:.2f} GB, {keep}: {d['kept_bytes'] / gb:.2f} GB (GB = 10^9 B; all "
            f"ranks together, on the filesystem of --output_dir)\n"
            f"  one save = " + " + ".join(parts) + f"; {d['kept']} of the run's {d['saves_in_run']} saves stay, and "
            f"{d['during_save_bytes'] / gb:.2f} GB while the next one is written (the oldest goes after it)")


def deepspeed_model_states(total: int, largest: int, world: int, gpus_per_node: int, offload_optimizer: bool,
                           offload_param: bool) -> int | None:
    """DeepSpeed's own per-GPU figure (estimate_zero3_model_states_mem_needs, the function behind
    estimate_zero3_model_states_mem_needs_all_cold), or None when deepspeed cannot be imported."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except Exception:  # noqa: BLE001 - the plan stands without it
        return None
    gpn = gpus_per_node if world % gpus_per_node == 0 else world
    _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=gpn, num_nodes=world // gpn,
                                                      cpu_offload=offload_optimizer,
                                                      cpu_offload_params=offload_param and offload_optimizer)
    return gpu


def plan(cfg, world: int, gpus_per_node: int | None = None, arch: dict | None = None, arch_source: str = "",
         with_deepspeed: bool = True) -> dict:
    """The memory plan as a JSON-able dict (bytes per GPU unless a key says otherwise)."""
    from training.algorithm.logprobs import auto_chunk_size   # one source of truth for the head's chunk

    if arch is None:
        arch, arch_source = load_arch(cfg.model.model_path)
    gpn = gpus_per_node or min(world, ASSUMED_WORLD)
    c = count_params(arch)
    m, r, ds = cfg.model, cfg.rollout, cfg.deepspeed
    b = 2 if m.dtype == "bf16" else 4
    n, p, top = world, c["total"], m.train_top_layers
    pt = trainable_params(c, top)
    all_trainable = pt == p
    h, t, v = c["hidden"], cfg.optimisation.micro_token_budget, c["vocab"]
    l_t = min(top, c["layers"]) if top > 0 else c["layers"]
    largest_trainable = c["largest"] if all_trainable else c["largest_in_layer"]
    off_o, off_p = ds.offload_optimizer, ds.offload_param and ds.zero_stage == 3
    master = 4 if b == 2 else 0                      # fp32 params are their own master copy
    kl = needs_reference(cfg)
    pc, pct = critic_params(cfg, c)
    cc = cfg.critic
    critic_p, critic_go = b * pc // n, (b + master + 8) * pct // n      # params; grads + optimizer

    states = {"params": 0 if off_p else b * p // n,
              "grads": 0 if off_o else b * pt // n,
              "optimizer": 0 if off_o else (master + 8) * pt // n,
              "reference": b * p // n if kl and not ds.ref_offload else 0,
              "critic": critic_p * (not cc.critic_offload_param) + critic_go * (not cc.critic_offload_optimizer)}
    # ZeRO-3 gathers modules up to stage3_max_live_parameters (3e7 in build_ds_config), and a
    # bigger module whole; a module's full gradient exists until its reduce-scatter.
    from training.engine.engine_builder import build_ds_config
    z = build_ds_config(cfg, train=True)["zero_optimization"]
    buckets = b * int(z["stage3_prefetch_bucket_size"] + z["reduce_bucket_size"])
    per_tok_layer = b * (10 * h + 4 * c["kv_width"] + 4 * c["intermediate"])
    ckpt = m.gradient_checkpointing
    saved = (l_t * t * h * b if ckpt else l_t * t * per_tok_layer) + 2 * t * h * b   # + final hidden, its grad
    chunk = auto_chunk_size(v, t)
    head_trains = all_trainable                      # freeze_lower_layers freezes embeddings and lm_head
    head = chunk * v * b + ((8 + b) * v * h if b == 2 else 4 * v * h) * head_trains
    # Backward meets the head first (its gathered weight, its buffers, its full grad), and the layers
    # after it (one layer's recomputed activations under checkpointing): two moments, the larger counts.
    # Measured on an H100 (bench/memory_plan_gpu.py): this is 5-8% above the real forward+backward peak.
    bwd_head = head + b * v * h * (1 + head_trains)
    layer_live = min(p, max(c["largest_in_layer"], int(z["stage3_max_live_parameters"])))
    bwd_layer = (t * per_tok_layer if ckpt else 0) + b * layer_live + b * c["largest_in_layer"]
    step = 0 if off_o else 8 * min(pt // n, SUB_GROUP_SIZE)
    resident = sum(states.values())
    working = saved + buckets + max(bwd_head, bwd_layer)
    # --rollout_engine hf: a full model copy per GPU that never sleeps (HFEngine.sleep is a no-op)
    hf = r.rollout_engine == "hf"
    hf_copy = b * p if hf else 0
    retriever = int(getattr(ds, "retriever_gpu_gb", 0.0) * GiB)   # a retrieval server on this GPU: both phases
    train_peak = resident + hf_copy + max(working, step) + RUNTIME_OVERHEAD + retriever
    act_full = l_t * t * per_tok_layer + 2 * t * h * b                 # the two settings side by side
    act_ckpt = l_t * t * h * b + t * per_tok_layer + 2 * t * h * b

    gpu = int(ds.gpu_memory_gb * GiB)
    tp = r.vllm_tp
    kv_per_tok = 2 * c["layers"] * max(1, c["kv_heads"] // tp) * c["head_dim"] * b
    if hf:  # its weights plus a dense KV cache of one generate batch (64 prompts) at --max_model_len
        vllm_weights = hf_copy
        kv_cache = HF_BATCH * r.max_model_len * kv_per_tok
        vllm_total = vllm_weights + kv_cache
    else:
        vllm_total = int(r.gpu_memory_utilization * gpu)
        vllm_weights = b * p // tp
        kv_cache = vllm_total - vllm_weights - VLLM_NON_KV
    kv_tokens = max(0, kv_cache) // kv_per_tok
    # During the sync, vLLM's weights are awake, its KV cache not yet, and one bucket is gathered.
    sync_moment = vllm_weights + max(r.sync_bucket_mb << 20, b * c["layer"])
    gen_resident = resident                          # ZeRO-3 partitions and optimizer stay unless offloaded
    gen_peak = gen_resident + max(vllm_total, sync_moment) + RUNTIME_OVERHEAD + retriever

    level = sleep_level(cfg)
    host = {"vllm_weights_level1": vllm_weights if level == 1 and not hf else 0,
            "grads_optimizer": (b + 4 + 8) * pt // n if off_o else 0,
            "params": b * p // n if off_p else 0,
            "reference": b * p // n if kl and ds.ref_offload else 0,
            "critic": critic_p * cc.critic_offload_param + critic_go * cc.critic_offload_optimizer}
    sent = p if all_trainable else pt
    ours_ds_terms = states["params"] + states["grads"] + states["optimizer"] + b * c["largest"] + b * largest_trainable
    ds_est = (deepspeed_model_states(p, c["largest"], n, gpn, off_o, off_p) if with_deepspeed else None)
    out = dict(model=m.model_path, arch_source=arch_source, params=p, trainable=pt, critic_params=pc, world=n, gpus_per_node=gpn,
               dtype=m.dtype, gpu_memory_gb=ds.gpu_memory_gb, sleep_level=level,
               train=dict(**states, activations_saved=saved, backward_head=bwd_head, backward_layer=bwd_layer,
                          buckets=buckets, working_set=working, activations_no_ckpt=act_full,
                          activations_ckpt=act_ckpt, logprob_head=head, optimizer_step_transient=step,
                          runtime=RUNTIME_OVERHEAD, retriever=retriever, peak=train_peak),
               generate=dict(train_resident=gen_resident, vllm_total=vllm_total, vllm_weights=vllm_weights,
                             kv_cache=kv_cache, kv_tokens=kv_tokens, sync_moment=sync_moment,
                             runtime=RUNTIME_OVERHEAD, retriever=retriever, peak=gen_peak),
               host_per_gpu=dict(**host, total=sum(host.values())),
               model_states=dict(ours=ours_ds_terms, deepspeed=ds_est),
               sync_bytes_per_step=b * sent, sync_all_weights=all_trainable, logprob_chunk=chunk,
               micro_token_budget=t, gradient_checkpointing=m.gradient_checkpointing,
               disk=checkpoint_disk(cfg, n, c))
    out["peak_phase"] = "train" if train_peak >= gen_peak else "generate"
    out["warnings"] = plan_warnings(cfg, out)
    return out


def plan_warnings(cfg, pl: dict) -> list[str]:
    """Loud lines for every estimate over --gpu_memory_gb, each naming what to change."""
    limit, ds, m, r = pl["gpu_memory_gb"], cfg.deepspeed, cfg.model, cfg.rollout
    out = []
    tr, gen = pl["train"]["peak"] / GiB, pl["generate"]["peak"] / GiB
    if tr > limit:
        fix = [f for f, on in (("--offload_optimizer true", not ds.offload_optimizer),
                               ("--offload_param true", not ds.offload_param),
                               ("--gradient_checkpointing true", not m.gradient_checkpointing),
                               ("--ref_offload true", pl["train"]["reference"] > 0),
                               ("--critic_offload_optimizer true", pl["train"]["critic"] > 0
                                and not cfg.critic.critic_offload_optimizer)) if on]
        fix += [f"a smaller --micro_token_budget (now {pl['micro_token_budget']}, not below --max_total_tokens)",
                "--train_top_layers N", f"more GPUs (ZeRO-3 partitions shrink with the world, now {pl['world']})"]
        fix += [_retriever_fix(pl)] * (pl["train"]["retriever"] > 0)
        out.append(f"WARNING: train phase needs ~{tr:.1f} GiB per GPU, over --gpu_memory_gb {limit:g}: try "
                   + ", ".join(fix))
    if gen > limit:
        fix = [f"a lower --gpu_memory_utilization (now {r.gpu_memory_utilization:g})"]
        fix += ["--offload_optimizer true (optimizer states stay on the GPU while vLLM is awake)"] * (not ds.offload_optimizer)
        fix += ["--offload_param true"] * (not ds.offload_param)
        fix += ["--critic_offload_optimizer true (the critic's states stay too)"] * (
            pl["train"]["critic"] > 0 and not cfg.critic.critic_offload_optimizer)
        fix += [f"more GPUs (now {pl['world']})"]
        fix += [_retriever_fix(pl)] * (pl["generate"]["retriever"] > 0)
        out.append(f"WARNING: generate phase needs ~{gen:.1f} GiB per GPU, over --gpu_memory_gb {limit:g}: try "
                   + ", ".join(fix))
    g = pl["generate"]
    if g["kv_cache"] <= 0:
        out.append(f"WARNING: generate phase: vLLM's share ({g['vllm_total'] / GiB:.1f} GiB = --gpu_memory_utilization "
                   f"{r.gpu_memory_utilization:g} x {limit:g}) does not hold its weights ({g['vllm_weights'] / GiB:.1f} "
                   f"GiB at TP {r.vllm_tp}) plus ~{VLLM_NON_KV / GiB:.0f} GiB: raise --gpu_memory_utilization or --vllm_tp")
    elif g["kv_tokens"] < r.max_model_len:
        out.append(f"WARNING: generate phase: vLLM's KV cache holds ~{g['kv_tokens']} tokens, less than one "
                   f"--max_model_len {r.max_model_len} sequence: raise --gpu_memory_utilization or --vllm_tp")
    return out


def _retriever_fix(pl: dict) -> str:
    return (f"the retrieval server's index on GPUs training does not use, or over more of them (its --faiss-gpus; "
            f"{pl['train']['retriever'] / GiB:.1f} GiB of each GPU now, --retriever_gpu_gb)")


def dry_run_report(cfg, world: int | None, gpus_per_node: int | None = None) -> str:
    """What train.py --dry_run prints: the plan at the launcher's world size, or at an assumed one."""
    note = ""
    if not world:
        world, note = ASSUMED_WORLD, (f"memory plan: world size unknown (not started by a launcher): it assumes "
                                      f"{ASSUMED_WORLD} GPUs, one node\n")
    try:
        return note + format_plan(plan(cfg, world, gpus_per_node))
    except (LookupError, ValueError) as e:
        return f"memory plan: skipped ({e})"


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f}"


def format_plan(pl: dict) -> str:
    """A compact table for the dry run."""
    tr, g, hst, ms = pl["train"], pl["generate"], pl["host_per_gpu"], pl["model_states"]
    n = pl["world"]
    rows = [("train phase (vLLM asleep)", ""),
            (f"  actor params, ZeRO-3 partition 1/{n}", _gib(tr["params"])),
            ("  grads (trainable)", _gib(tr["grads"])),
            ("  fp32 master + Adam m, v (trainable)", _gib(tr["optimizer"])),
            ("  reference params", _gib(tr["reference"])),
            (f"  critic ({pl['critic_params'] / 1e9:.2f}B): params + grads + fp32 master + Adam m, v", _gib(tr["critic"])),
            (f"  activations kept for backward, {pl['micro_token_budget']} tokens, "
             f"{'with' if pl['gradient_checkpointing'] else 'no'} grad ckpt", _gib(tr["activations_saved"])),
            (f"  backward at the log-prob head (gathered lm_head, chunk {pl['logprob_chunk']} x vocab, "
             f"fp32 dW if it trains)", _gib(tr["backward_head"])),
            ("  backward in a layer (recomputed activations, gathered modules)", _gib(tr["backward_layer"])),
            ("  ZeRO-3 prefetch + reduce buckets", _gib(tr["buckets"])),
            ("  = forward+backward working set (saved + buckets + the larger moment)", _gib(tr["working_set"])),
            ("  optimizer step transient (after backward: max, not sum)", _gib(tr["optimizer_step_transient"])),
            ("  runtime (CUDA context, NCCL, workspaces; assumed)", _gib(tr["runtime"])),
            ("  retrieval server on this GPU (--retriever_gpu_gb)", _gib(tr["retriever"])),
            ("  PEAK train", _gib(tr["peak"])),
            (f"  (all activations, grad ckpt on / off: {_gib(tr['activations_ckpt'])} / "
             f"{_gib(tr['activations_no_ckpt'])})", ""),
            ("generate phase (vLLM awake)", ""),
            ("  train state left resident", _gib(g["train_resident"])),
            (f"  vLLM share (--gpu_memory_utilization x {pl['gpu_memory_gb']:g} GiB)", _gib(g["vllm_total"])),
            ("    of which weights at --vllm_tp", _gib(g["vllm_weights"])),
            (f"    of which KV cache (~{g['kv_tokens']} tokens)", _gib(g["kv_cache"])),
            ("  runtime (assumed)", _gib(g["runtime"])),
            ("  retrieval server on this GPU (--retriever_gpu_gb)", _gib(g["retriever"])),
            ("  PEAK generate", _gib(g["peak"]))]
    w = max(len(a) for a, _ in rows)
    head = (f"memory plan per GPU, GiB (2^30 B): {pl['model']} ({pl['params'] / 1e9:.2f}B params, "
            f"{pl['trainable'] / 1e9:.2f}B trainable, {pl['dtype']}), world {n} ({n // pl['gpus_per_node'] if n % pl['gpus_per_node'] == 0 else 1} node(s) x "
            f"{pl['gpus_per_node'] if n % pl['gpus_per_node'] == 0 else n})")
    lines = [head, f"  architecture from {pl['arch_source']}"] + [f"  {a:<{w}}  {b_:>7}" for a, b_ in rows]
    why = ("DeepSpeed assumes every weight trains" if pl["trainable"] < pl["params"] else
           "equal terms under optimizer offload" if tr["optimizer"] == 0 else
           "its rule counts 18 B/param; stage3.py allocates 16, its fp32 grad copy is our step transient")
    lines.append(f"  model states (partitions + largest module and its grad): ours {_gib(ms['ours'])} GiB, "
                 f"DeepSpeed's estimator {_gib(ms['deepspeed'])} GiB ({why})")
    what = "every weight" if pl["sync_all_weights"] else "the trainable layers only"
    lines.append(f"  weight sync per step: {pl['sync_bytes_per_step'] / GiB:.2f} GiB gathered and loaded into vLLM "
                 f"per rank ({what})")
    lvl = pl["sleep_level"]
    lines.append(f"  vLLM sleep level {lvl} ({'weights kept in host RAM' if lvl == 1 else 'weights and KV discarded'}); "
                 f"host RAM per GPU {_gib(hst['total'])} GiB, x{pl['gpus_per_node']} per node (vLLM weights {_gib(hst['vllm_weights_level1'])}, "
                 f"offloaded grads+optimizer {_gib(hst['grads_optimizer'])}, params {_gib(hst['params'])}, "
                 f"reference {_gib(hst['reference'])}, critic {_gib(hst['critic'])})")
    lines.append(f"  peak phase: {pl['peak_phase']} ({max(tr['peak'], g['peak']) / GiB:.1f} of "
                 f"{pl['gpu_memory_gb']:g} GiB)")
    lines.append(format_disk(pl["disk"]))
    return "\n".join(lines + pl["warnings"])
