"""training/engine/memory_plan.py: the per-GPU memory plan that train.py --dry_run prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.engine import memory_plan as mp
from training.settings.config import Config

REPO = Path(__file__).resolve().parents[2]
GiB = mp.GiB


def _cfg(model="Qwen/Qwen2.5-7B", **flags) -> Config:
    cfg = Config()
    cfg.model.model_path = model
    cfg.optimisation.micro_token_budget = 16384
    for k, v in flags.items():
        for group in ("model", "rollout", "deepspeed", "algorithm", "optimisation", "critic"):
            if hasattr(getattr(cfg, group), k):
                setattr(getattr(cfg, group), k, v)
                break
        else:
            raise KeyError(k)
    return cfg


# ----------------------------------------------------------------------------- against DeepSpeed's estimator

@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-32B", "meta-llama/Llama-3.1-8B"])
@pytest.mark.parametrize("world,gpn", [(8, 8), (16, 8), (2, 2)])
def test_model_states_agree_with_deepspeeds_estimator(model, world, gpn):
    """Every weight trainable, bf16. DeepSpeed's estimate_zero3_model_states_mem_needs counts
    4 B x largest module + 18 B/param / N without offload; we count the same largest-module term
    (bf16 param + its bf16 grad) and the 16 B/param that stage3.py allocates (bf16 partition 2,
    grad_partitions_flat_buffer 2, fp32 master 4, Adam m and v 8): the difference is exactly
    2 B x P / N (+-3 B of integer rounding, one per floored term). With optimizer offload (and with
    param offload too) the terms are the same, so the numbers agree to the rounding of one term."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    for off_o, off_p in ((False, False), (True, False), (True, True)):
        pl = mp.plan(_cfg(model, offload_optimizer=off_o, offload_param=off_p), world, gpn)
        ours, theirs = pl["model_states"]["ours"], pl["model_states"]["deepspeed"]
        p = pl["params"]
        largest = mp.count_params(mp.load_arch(model)[0])["largest"]
        _, direct, _ = estimate_zero3_model_states_mem_needs(p, largest, gpn, world // gpn, cpu_offload=off_o,
                                                             cpu_offload_params=off_p)
        assert theirs == direct
        extra = 0 if off_o else 2 * p / world
        assert abs(theirs - ours - extra) <= 3, (off_o, off_p, theirs, ours)


def test_train_top_layers_shrinks_grads_and_optimizer_states():
    full = mp.plan(_cfg(), 8, 8)
    top = mp.plan(_cfg(train_top_layers=4), 8, 8)
    c = mp.count_params(mp.ARCHS["qwen2.5-7b"])
    pt = 4 * c["layer"] + c["hidden"]                       # the top 4 layers and the final norm
    assert top["trainable"] == pt and full["trainable"] == full["params"] == c["total"]
    assert top["train"]["params"] == full["train"]["params"]      # frozen weights are still held
    assert top["train"]["grads"] == 2 * pt // 8 and full["train"]["grads"] == 2 * c["total"] // 8
    assert top["train"]["optimizer"] == 12 * pt // 8 and full["train"]["optimizer"] == 12 * c["total"] // 8
    assert top["train"]["activations_saved"] < full["train"]["activations_saved"]   # frozen layers keep no graph
    assert top["sync_bytes_per_step"] == 2 * pt and full["sync_bytes_per_step"] == 2 * c["total"]
    assert top["sleep_level"] == 1 and full["sleep_level"] == 2
    assert top["host_per_gpu"]["vllm_weights_level1"] == 2 * c["total"]   # level 1 parks vLLM's weights in RAM
    assert full["host_per_gpu"]["vllm_weights_level1"] == 0


def test_offload_moves_states_to_host():
    pl = mp.plan(_cfg(offload_optimizer=True, offload_param=True), 8, 8)
    assert pl["train"]["params"] == pl["train"]["grads"] == pl["train"]["optimizer"] == 0
    assert pl["train"]["optimizer_step_transient"] == 0
    assert pl["host_per_gpu"]["grads_optimizer"] == (2 + 12) * pl["params"] // 8
    assert pl["generate"]["train_resident"] == 0


def test_gradient_checkpointing_and_reference_model():
    on, off = mp.plan(_cfg(), 8, 8), mp.plan(_cfg(gradient_checkpointing=False), 8, 8)
    assert on["train"]["activations_ckpt"] < off["train"]["activations_no_ckpt"]
    assert on["train"]["activations_saved"] < off["train"]["activations_saved"]
    assert on["train"]["backward_layer"] > off["train"]["backward_layer"]      # the recomputed layer
    assert on["train"]["activations_ckpt"] == (on["train"]["activations_saved"] + on["train"]["backward_layer"]
                                               - off["train"]["backward_layer"])
    assert off["train"]["activations_no_ckpt"] == off["train"]["activations_saved"]
    ref_gpu = mp.plan(_cfg(kl_coef=0.01, ref_offload=False), 8, 8)
    ref_host = mp.plan(_cfg(kl_coef=0.01, ref_offload=True), 8, 8)
    assert ref_gpu["train"]["reference"] == 2 * on["params"] // 8 == ref_host["host_per_gpu"]["reference"]
    assert ref_host["train"]["reference"] == 0 and on["train"]["reference"] == 0


def test_logprob_head_chunk_follows_training_logprobs():
    from training.algorithm.logprobs import auto_chunk_size
    pl = mp.plan(_cfg(), 8, 8)
    v, h = mp.ARCHS["qwen2.5-7b"]["vocab_size"], mp.ARCHS["qwen2.5-7b"]["hidden_size"]
    assert pl["logprob_chunk"] == auto_chunk_size(v, 16384)
    assert pl["train"]["logprob_head"] == pl["logprob_chunk"] * v * 2 + 10 * v * h   # + the trained head's fp32 dW


def test_plan_stays_just_above_the_h100_measurement():
    """bench/memory_plan_gpu.json: torch.cuda.max_memory_allocated of the repo's ZeRO-3 step on an H100
    (world 1, Qwen2.5-0.5B/1.5B shapes). The plan must not undershoot, and not overshoot by more than
    15% (it came out 5-8% high on the forward+backward, within 0.4% on states and step)."""
    import json
    sys.path.insert(0, str(REPO))
    from bench.memory_plan_gpu import planned
    runs = json.loads((REPO / "bench" / "memory_plan_gpu.json").read_text())
    assert runs and all("H100" in r["device"] for r in runs)
    for r in runs:
        p, m = planned(r["shape"], r["gradient_checkpointing"], r["tokens"]), r["measured"]
        assert abs(p["states"] / m["states"] - 1) < 0.01 and abs(p["step"] / m["step"] - 1) < 0.01, r["shape"]
        assert 1.0 <= p["fwd_bwd"] / m["fwd_bwd"] < 1.15, (r["shape"], p["fwd_bwd"], m["fwd_bwd"])
        assert 0.99 <= p["peak_without_runtime"] / r["measured_peak"] < 1.15


# ----------------------------------------------------------------------------- parameter counts

def _tiny(kind: str, tied: bool):
    import transformers as T
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied)
    if kind == "llama":
        return T.LlamaConfig(**common), T.LlamaForCausalLM
    if kind == "llama_bias":
        return T.LlamaConfig(**common, attention_bias=True, mlp_bias=True), T.LlamaForCausalLM
    if kind == "qwen2":
        return T.Qwen2Config(**common), T.Qwen2ForCausalLM
    return T.Qwen3Config(**common, head_dim=24), T.Qwen3ForCausalLM


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_param_count_equals_a_real_transformers_model(kind, tied):
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params

    from training.engine.engine_builder import freeze_lower_layers
    config, cls = _tiny(kind, tied)
    torch.manual_seed(0)
    model = cls(config)
    counts = mp.count_params(config.to_dict())
    real_total, real_largest = model_to_params(model)     # DeepSpeed's own count (tied weights once)
    assert counts["total"] == real_total == sum(p.numel() for p in model.parameters())
    assert counts["largest"] == real_largest
    assert mp.trainable_params(counts, 2) == freeze_lower_layers(model, 2)


def test_the_built_in_table_matches_the_published_sizes():
    published = {"qwen2.5-3b": 3.09e9, "qwen2.5-7b": 7.62e9, "qwen2.5-14b": 14.77e9, "qwen2.5-32b": 32.76e9,
                 "llama-3.1-8b": 8.03e9, "qwen3-8b": 8.19e9}
    for key, n in published.items():
        assert abs(mp.count_params(mp.ARCHS[key])["total"] / n - 1) < 0.005, key


def test_arch_comes_from_config_json_when_local(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(mp.ARCHS["qwen3-8b"]))
    arch, source = mp.load_arch(str(tmp_path))
    assert arch == mp.ARCHS["qwen3-8b"] and source.endswith("config.json")
    assert "built-in table" in mp.load_arch("Qwen/Qwen2.5-7B-Instruct")[1]
    with pytest.raises(LookupError):
        mp.load_arch("someone/unknown-model")
    assert mp.dry_run_report(_cfg("someone/unknown-model"), 8).startswith("memory plan: skipped")


# ----------------------------------------------------------------------------- warnings and sleep level

def test_warning_fires_above_the_limit_and_not_below():
    ok = mp.plan(_cfg(gpu_memory_gb=80.0), 8, 8)
    assert ok["warnings"] == [] and "WARNING" not in mp.format_plan(ok)
    # vLLM takes its fraction of *this* GPU: 0.7 x 40 = 28 GiB on top of ~14 GiB of resident ZeRO-3
    # states (+ 2 runtime) is over 40; the train phase (~30 GiB) is not.
    tight = _cfg(gpu_memory_gb=40.0, gpu_memory_utilization=0.7)
    pl = mp.plan(tight, 8, 8)
    assert pl["train"]["peak"] < 40 * GiB < pl["generate"]["peak"]
    assert len(pl["warnings"]) == 1
    w = pl["warnings"][0]
    assert w.startswith("WARNING: generate phase needs ~") and "over --gpu_memory_gb 40" in w
    assert "--gpu_memory_utilization" in w and "--offload_optimizer true" in w
    assert w in mp.format_plan(pl)
    small = mp.plan(_cfg(gpu_memory_gb=24.0, gpu_memory_utilization=0.9), 8, 8)
    train_w = [x for x in small["warnings"] if x.startswith("WARNING: train phase")]
    assert train_w and "--offload_optimizer true" in train_w[0] and "--micro_token_budget" in train_w[0]
    assert "more GPUs" in train_w[0]


def test_kv_cache_warning_when_vllm_share_cannot_hold_its_weights():
    pl = mp.plan(_cfg("Qwen/Qwen2.5-32B", gpu_memory_utilization=0.35), 8, 8)   # 61 GiB of weights in 28
    assert any("does not hold its weights" in w for w in pl["warnings"])
    assert not any("does not hold" in w for w in mp.plan(_cfg("Qwen/Qwen2.5-32B", vllm_tp=4,
                                                                gpu_memory_utilization=0.4), 8, 8)["warnings"])


def test_sleep_level_rule():
    assert mp.sleep_level(_cfg()) == 2
    assert mp.sleep_level(_cfg(train_top_layers=1)) == 1
    assert mp.sleep_level(_cfg(train_top_layers=8)) == 1


# ----------------------------------------------------------------------------- the scripts and the dry run

def test_every_model_script_fits_8x80gb_and_the_search_r1_config_fits():
    """The flags come from the scripts themselves (bash with a stand-in `deepspeed`)."""
    sys.path.insert(0, str(REPO))
    from bench.memory_plan import MODEL_SCRIPTS, SEARCH_R1_ARGV, config_from_argv, script_argv
    assert len(MODEL_SCRIPTS) == 10
    argv = script_argv(REPO / "scripts" / "train_qwen2.5_32b_base.sh")
    assert argv[argv.index("--model_path") + 1] == "Qwen/Qwen2.5-32B"
    assert argv[argv.index("--vllm_tp") + 1] == "4" and argv[argv.index("--offload_optimizer") + 1] == "true"
    for script in MODEL_SCRIPTS:
        pl = mp.plan(config_from_argv(script_argv(script)), 8, 8)
        assert pl["warnings"] == [], (script.name, pl["warnings"])
    sr = mp.plan(config_from_argv(SEARCH_R1_ARGV), 8, 8)
    assert max(sr["train"]["peak"], sr["generate"]["peak"]) < 80 * GiB


def test_dry_run_prints_the_plan(tmp_path):
    """A per-size script's own flags through train.py --dry_run, as local rank 0 of a world of 8."""
    sys.path.insert(0, str(REPO))
    from bench.memory_plan import script_argv
    argv = script_argv(REPO / "scripts" / "train_qwen2.5_7b_instruct.sh")
    env = dict(os.environ, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WORLD_SIZE="8",
               RANK="0", LOCAL_RANK="0", LOCAL_SIZE="8", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"))
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *argv, "--dry_run", "--gpu_memory_gb", "40",
                        "--gpu_memory_utilization", "0.7"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert out.index("DeepSpeed config (actor)") < out.index("memory plan per GPU") < out.index("dry run: ok")
    assert "Qwen/Qwen2.5-7B-Instruct" in out and "world 8 (1 node(s) x 8)" in out and "built-in table" in out
    assert "PEAK train" in out and "PEAK generate" in out and "weight sync per step: 14.19 GiB" in out
    assert "WARNING: generate phase needs ~" in out and "over --gpu_memory_gb 40" in out
    # the checkpoint disk: 12 B (fp32 master + Adam m, v) + 2 B (bf16 HF export) per parameter, 3 kept
    import re
    m = re.search(r"^disk: one save ([\d.]+) GB, --max_ckpts 3 kept: ([\d.]+) GB", out, re.M)
    assert m, out[-3000:]
    p = mp.count_params(mp.ARCHS["qwen2.5-7b"])["total"]
    assert abs(float(m.group(1)) / (14 * p / 1e9) - 1) < 0.01 and float(m.group(2)) == pytest.approx(3 * float(m.group(1)), abs=0.02)


def test_retriever_on_the_training_gpus_adds_to_both_phases():
    """--retriever_gpu_gb: a retrieval server's share of each training GPU never sleeps, so both
    peaks carry it, and the warning names it as something to move."""
    base = mp.plan(_cfg(), 8, 8, with_deepspeed=False)
    shared = mp.plan(_cfg(retriever_gpu_gb=9.0), 8, 8, with_deepspeed=False)
    assert base["train"]["retriever"] == base["generate"]["retriever"] == 0
    for phase in ("train", "generate"):
        assert shared[phase]["peak"] - base[phase]["peak"] == 9 * GiB == shared[phase]["retriever"]
    assert base["warnings"] == [] and shared["warnings"] == []
    assert "retrieval server on this GPU (--retriever_gpu_gb)" in mp.format_plan(shared)
    over = mp.plan(_cfg(retriever_gpu_gb=40.0), 8, 8, with_deepspeed=False)
    w = [x for x in over["warnings"] if x.startswith("WARNING: generate phase")]
    assert w and "--faiss-gpus" in w[0] and "40.0 GiB of each GPU now, --retriever_gpu_gb" in w[0]


def test_retriever_gpu_gb_may_change_on_resume():
    from training.engine.run_state import OPERATIONAL
    assert {"deepspeed.retriever_gpu_gb", "deepspeed.gpu_memory_gb"} <= OPERATIONAL


def test_hf_rollout_engine_keeps_a_full_copy_in_both_phases():
    """--rollout_engine hf: the transformers copy never sleeps, so both phases carry b*P more than the
    training states, and nothing is parked in host RAM for a level-1 wake-up."""
    vllm = mp.plan(_cfg(train_top_layers=4), world=8, with_deepspeed=False)
    hf = mp.plan(_cfg(train_top_layers=4, rollout_engine="hf"), world=8, with_deepspeed=False)
    copy = 2 * hf["params"]
    assert hf["train"]["peak"] - vllm["train"]["peak"] == copy
    assert hf["generate"]["vllm_weights"] == copy
    assert hf["generate"]["kv_cache"] == mp.HF_BATCH * 4096 * 2 * 28 * 4 * 128 * 2   # 64 x max_model_len x K,V
    assert vllm["host_per_gpu"]["vllm_weights_level1"] > 0 and hf["host_per_gpu"]["vllm_weights_level1"] == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_critic_params_equal_the_real_value_model(kind, tied):
    """The critic is veRL's token-classification model (training/algorithm/critic.py): the plan's Pc and Pct equal
    a real one's counts, with and without --critic_train_top_layers."""
    import torch
    import transformers as T

    from training.engine.engine_builder import freeze_lower_layers
    config, _ = _tiny(kind, tied)
    config.num_labels = 1
    torch.manual_seed(0)
    model = T.AutoModelForTokenClassification.from_config(config)
    counts = mp.count_params(config.to_dict())
    cfg = _cfg(solver_estimator="gae")
    assert mp.critic_params(cfg, counts) == (sum(p.numel() for p in model.parameters()),) * 2
    cfg.critic.critic_train_top_layers = 2
    freeze_lower_layers(model, 2)
    model.score.requires_grad_(True)
    assert mp.critic_params(cfg, counts)[1] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mp.critic_params(_cfg(), counts) == (0, 0)


def test_the_critic_adds_its_states_to_both_phases_and_the_checkpoint():
    base, gae = mp.plan(_cfg(), 8, 8), mp.plan(_cfg(solver_estimator="gae"), 8, 8)
    pc = gae["critic_params"]
    assert base["train"]["critic"] == 0 and pc > 0.9 * base["params"]
    assert gae["train"]["critic"] == 2 * pc // 8 + (2 + 4 + 8) * pc // 8    # bf16 params; grads, fp32 master, m, v
    assert gae["train"]["peak"] - base["train"]["peak"] == gae["train"]["critic"]
    assert gae["generate"]["peak"] - base["generate"]["peak"] == gae["train"]["critic"]   # resident while vLLM wakes
    assert gae["disk"]["one_save"] - base["disk"]["one_save"] == 12 * pc
    cfg = _cfg(solver_estimator="gae")
    cfg.critic.critic_offload_optimizer = cfg.critic.critic_offload_param = True
    off = mp.plan(cfg, 8, 8)
    assert off["train"]["critic"] == 0 and off["host_per_gpu"]["critic"] == gae["train"]["critic"]
