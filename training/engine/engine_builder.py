"""Engine builder: DeepSpeed config (built in code) -> model -> optimizer -> deepspeed.initialize (the LR follows
training/algorithm/lr_schedule.py's set_lr).

Kept apart from the trainer that uses the engines (DeepSpeed-Chat's split). Builds
the actor and, when asked, a frozen reference model and a PPO critic (its own ZeRO-3
engine, optimizer, LR schedule and gradient clipping; the value model is training/algorithm/critic.py's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.settings.config import Config, needs_critic, needs_reference
from training.algorithm.critic import load_value_model


def build_ds_config(cfg: Config, *, train: bool = True, offload_param: bool | None = None,
                    offload_optimizer: bool | None = None, grad_clip: float | None = None) -> dict:
    """The DeepSpeed config dict. Micro-batching is ours (packed rows, variable count per step),
    so DeepSpeed sees micro-batch 1 and no accumulation; the trainer marks the accumulation
    boundary itself and the loss carries the global normaliser (training/algorithm/loss.py)."""
    ds, o = cfg.deepspeed, cfg.optimisation
    offload_param = ds.offload_param if offload_param is None else offload_param
    offload_optimizer = ds.offload_optimizer if offload_optimizer is None else offload_optimizer
    zero: dict = {
        "stage": ds.zero_stage,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 5e6,
        "reduce_bucket_size": 5e6,
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if offload_param and ds.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if train and offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    conf = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Otherwise deepspeed.initialize swaps torch.nn.functional.linear process-wide (docs/PLATFORM_NOTES.md, DeepSpeed on CPU).
        "memory_efficient_linear": False,
    }
    if train:
        conf["gradient_clipping"] = o.max_grad_norm if grad_clip is None else grad_clip
    return conf


def _attn_impl(cfg: Config) -> str:
    if cfg.model.attn_implementation != "auto":
        return cfg.model.attn_implementation
    if torch.cuda.is_available():  # untested on GPU in CI: prefer flash-attn varlen when installed
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def freeze_lower_layers(model, top_layers: int) -> int:
    """Train only the last `top_layers` decoder layers and the final norm; freeze the rest
    (embeddings, a tied lm_head, the lower layers). 0 leaves every weight trainable.
    Returns the number of trainable parameters. Backward then stops at the first trained layer,
    and the hybrid engine never re-sends frozen layers to vLLM."""
    if top_layers <= 0:
        return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"--train_top_layers needs a decoder with .layers; {type(model.base_model).__name__} has none")
    if top_layers > len(layers):
        raise ValueError(f"--train_top_layers {top_layers} exceeds the model's {len(layers)} decoder layers")
    model.requires_grad_(False)
    for layer in list(layers)[len(layers) - top_layers:]:
        layer.requires_grad_(True)
    norm = getattr(model.base_model, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def _load_model(cfg: Config, ds_config: dict):
    """from_pretrained under an HfDeepSpeedConfig so ZeRO-3 partitions weights while loading."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keepalive = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model.model_path, dtype=dtype, attn_implementation=_attn_impl(cfg))
    # A KV cache disables transformers' packed-sequence mask detection: packed rows would
    # attend across sequences silently (docs/PLATFORM_NOTES.md, transformers packed sequences).
    model.config.use_cache = False
    return model, keepalive


def make_optimizer(cfg: Config, params, *, lr: float | None = None, weight_decay: float | None = None,
                   offload: bool | None = None):
    """The actor's optimizer; train.py --dry_run checks the same choice.
    No offload: torch AdamW, nothing is JIT-compiled (FusedAdam / CPU-Adam take ~150 s of gcc)
    and checkpoint restore is exact (docs/PLATFORM_NOTES.md, DeepSpeed ZeRO-3 rules).
    Optimizer offload: DeepSpeedCPUAdam, the optimizer made for it (deepspeed.initialize refuses
    a torch optimizer under offload unless "zero_force_ds_cpu_optimizer" is false); its op is
    JIT-built with gcc on first use (~150 s) and cached in TORCH_EXTENSIONS_DIR."""
    o = cfg.optimisation
    lr = o.lr if lr is None else lr
    weight_decay = o.weight_decay if weight_decay is None else weight_decay
    if cfg.deepspeed.offload_optimizer if offload is None else offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=weight_decay, adamw_mode=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass
class Engines:
    actor: object                 # deepspeed.DeepSpeedEngine
    ref: object | None            # frozen reference (DeepSpeedEngine in eval mode) or None
    ds_config: dict
    _keepalive: list              # HfDeepSpeedConfig objects must outlive the engines
    critic: object | None = None  # PPO critic (DeepSpeedEngine of training/algorithm/critic.py's value model) or None


def build_engines(cfg: Config) -> Engines:
    import deepspeed

    ds_config = build_ds_config(cfg, train=True)
    model, keep = _load_model(cfg, ds_config)
    freeze_lower_layers(model, cfg.model.train_top_layers)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    # No LR scheduler inside DeepSpeed: the trainers call set_lr once per step.
    actor, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    keepalive = [keep]

    ref = None
    if needs_reference(cfg):
        ref_cfg = build_ds_config(cfg, train=False, offload_param=cfg.deepspeed.ref_offload)
        ref_model, keep_ref = _load_model(cfg, ref_cfg)
        ref_model.requires_grad_(False)
        ref, *_ = deepspeed.initialize(model=ref_model, config=ref_cfg)
        ref.eval()
        keepalive.append(keep_ref)
    critic = None
    if needs_critic(cfg):
        critic, keep_critic = build_critic(cfg)
        keepalive.append(keep_critic)
    return Engines(actor=actor, ref=ref, ds_config=ds_config, _keepalive=keepalive, critic=critic)


def critic_ds_config(cfg: Config) -> dict:
    c = cfg.critic
    return build_ds_config(cfg, train=True, offload_param=c.critic_offload_param,
                           offload_optimizer=c.critic_offload_optimizer, grad_clip=c.critic_max_grad_norm)


def build_critic(cfg: Config, optimizer_fn=None):
    """The critic as DeepSpeed-Chat builds it: its ds config -> value model (from --critic_model_path, or
    the actor's start) -> its optimizer -> deepspeed.initialize. Returns (engine, HfDeepSpeedConfig
    keep-alive). `optimizer_fn(params)` replaces AdamW (the tests' plain SGD)."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    c = cfg.critic
    ds_config = critic_ds_config(cfg)
    keep = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = load_value_model(c.critic_model_path or cfg.model.model_path, dtype, _attn_impl(cfg))
    freeze_lower_layers(model, c.critic_train_top_layers)
    model.score.requires_grad_(True)          # the value head always trains
    if c.critic_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (optimizer_fn(params) if optimizer_fn is not None else
           make_optimizer(cfg, params, lr=c.critic_lr, weight_decay=c.critic_weight_decay,
                          offload=c.critic_offload_optimizer))
    if optimizer_fn is not None:
        ds_config = {**ds_config, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    return engine, keep
