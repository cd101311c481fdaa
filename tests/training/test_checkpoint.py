"""training/engine/checkpoint.py: nothing of a user's is overwritten without asking, checkpoints load with
torch.load(weights_only=True), a run killed in the middle of a checkpoint write resumes from the
previous one, and the HF export is sharded (save_pretrained's format) and round-trips through
from_pretrained and vLLM.

The multi-rank tests reuse tests/training/test_trainer.py's run set-up (`workdir`, `_args`,
`_torchrun`). The export test runs this file as a torchrun worker (`__main__` below).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.test_trainer import _args, _env, _stable, _torchrun, workdir  # noqa: F401 - workdir is a fixture

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the run folder

def _cfg(**changes) -> dict:
    from training.settings.config import Config

    d = Config().to_dict()
    for key, value in changes.items():
        group, name = key.split("__")
        d[group][name] = value
    return d


def _mark(path: Path, run: str | None, files=("x",)) -> Path:
    path.mkdir(parents=True)
    for f in files:
        (path / f).write_text(f)
    if run is not None:
        (path / "run_id").write_text(run + "\n")
    return path


def test_output_dir_of_another_run_is_refused_unless_overwrite(tmp_path):
    from training.engine import run_folder as RF
    from training.settings.config import ConfigError

    out = tmp_path / "run"
    rid = RF.claim_output_dir(out, _cfg())
    assert json.loads((out / "config.json").read_text()) == _cfg()
    assert (out / "checkpoints/run_id").read_text().strip() == rid
    # operational fields may change: the same run goes on, with the same id, and config.json follows
    later = _cfg(optimisation__total_steps=500, logging__log_every=7, eval__eval_every=3, checkpointing__save_every=1,
                 checkpointing__max_ckpts=9, deepspeed__local_rank=1, rollout__kv_cache_mb=512)
    assert RF.claim_output_dir(out, later) == rid
    assert json.loads((out / "config.json").read_text())["optimisation"]["total_steps"] == 500
    # a run-defining field differs: refused, naming the field with both values and both ways out
    with pytest.raises(ConfigError) as e:
        RF.claim_output_dir(out, _cfg(optimisation__lr=2e-5, selfplay__solver_n=8))
    msg = str(e.value)
    assert "optimisation.lr: 1e-06" in msg and "-> 2e-05" in msg and "selfplay.solver_n: 5" in msg and "-> 8" in msg
    assert "--overwrite true" in msg and "pick another --output_dir" in msg
    assert "total_steps" not in msg.split("Fields that may change")[0]
    assert json.loads((out / "config.json").read_text())["optimisation"]["lr"] == 1e-6  # untouched

    # with checkpoints of this run, one copied in by hand, and logs
    root = out / "checkpoints"
    for s in (1, 2):
        _mark(root / f"step_00000{s}", rid)
    _mark(root / "step_000007", None, files=("mine.txt",))
    (root / "latest").write_text("step_000002\n")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.md").write_text("the user's own notes\n")
    with pytest.raises(ConfigError, match="--resume none would start over"):
        RF.claim_output_dir(out, _cfg(checkpointing__resume="none"))
    assert (root / "step_000002").is_dir()
    # --overwrite starts over: this run's checkpoints and logs go, everything else stays
    new = RF.claim_output_dir(out, _cfg(optimisation__lr=2e-5, checkpointing__overwrite=True))
    assert new != rid and (root / "run_id").read_text().strip() == new
    assert sorted(p.name for p in root.iterdir()) == ["run_id", "step_000007"]
    assert (root / "step_000007/mine.txt").exists() and (out / "notes.md").exists() and not (out / "metrics.jsonl").exists()
    assert json.loads((out / "config.json").read_text())["optimisation"]["lr"] == 2e-5

    # checkpoints without a config.json (another tool's folder): their run is unknown, so refused
    other = tmp_path / "sft"
    _mark(other / "checkpoints/step_000004", None)
    (other / "checkpoints/latest").write_text("step_000004\n")
    with pytest.raises(ConfigError, match="holds checkpoints but no config.json"):
        RF.claim_output_dir(other, _cfg())


def test_config_diff_fields_missing_from_an_old_config_count_as_defaults():
    from training.engine import run_state as RS

    old = _cfg()
    del old["checkpointing"]["overwrite"], old["algorithm"]["ppo_epochs"]
    assert RS.config_diff(old, _cfg()) == {}
    assert RS.config_diff(old, _cfg(algorithm__ppo_epochs=2)) == {"algorithm.ppo_epochs": (1, 2)}
    # every operational key names a real field
    from utils.trackers import flat

    keys = set(flat(_cfg()))
    assert RS.OPERATIONAL <= keys, RS.OPERATIONAL - keys


@pytest.mark.timeout(300)
def test_train_py_refuses_an_output_dir_of_another_run(workdir, tiny_model_dir):  # noqa: F811
    """The real entry point (a world of one): the refusal comes before any model is built."""
    from training.settings.config import parse_config

    out = workdir / "run_refused"
    args = _args(workdir, tiny_model_dir, out)[1:] + ["--total_steps", "0"]
    out.mkdir()
    parse_config(args).save(out / "config.json")  # what an earlier launch with lr 1e-3 wrote
    r = subprocess.run([sys.executable, "train.py", *args, "--lr", "2e-3"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=280)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "optimisation.lr: 0.001" in r.stderr and "-> 0.002" in r.stderr, r.stderr[-3000:]
    assert "--overwrite true" in r.stderr and "--output_dir" in r.stderr
    assert json.loads((out / "config.json").read_text())["optimisation"]["lr"] == 1e-3


def test_rotation_deletes_only_this_runs_checkpoints(tmp_path):
    from training.engine import checkpoint as C

    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "run_id").write_text("ours\n")
    _mark(root / "step_000001", "another-run")        # another run's, in the same folder
    _mark(root / "step_000002", None)                 # copied in by hand, no run id
    for s in (3, 4, 5, 6):
        _mark(root / f"step_00000{s}", "ours")
    (root / "latest").write_text("step_000006\n")
    C._rotate(root, keep=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000001", "step_000002", "step_000005",
                                                                     "step_000006"]


def test_a_half_written_checkpoint_of_this_run_is_replaced_and_another_runs_moved_aside(tmp_path):
    from training.engine import checkpoint as C

    root = tmp_path / "checkpoints"
    half = _mark(root / "step_000003", "ours", files=("trainer_rank0.pt",))
    C._make_room(half, "ours", latest="step_000002")
    assert not half.exists()
    theirs = _mark(root / "step_000003", "theirs", files=("weights",))
    C._make_room(theirs, "ours", latest="step_000002")
    assert not theirs.exists() and (root / "step_000003.not-this-run/weights").read_text() == "weights"


# ----------------------------------------------------------------------------- weights_only

def test_client_state_loads_with_weights_only_and_restores_every_rng(tmp_path):
    from training.engine import checkpoint as C

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # numpy caches a gaussian: has_gauss = 1 must survive too
    pool_rng = random.Random(5)
    pool_rng.random()
    state = {"step": 4, "cursor": 8, "rng": C.rng_state(), "pool_rng": pool_rng.getstate(),
             "pool": [{"question": "Which opera?", "answer": ["Carmen"], "step": 2}],
             "ema_state": {"solver": {"baseline": 0.25, "count": 3}},
             "curriculum": {"step": 4, "rng": [3, list(random.Random(9).getstate()[1]), None], "stats": {"noisy": 2}}}
    expect = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    torch.save(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    C.set_rng_state(back["rng"])
    got = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    assert got[:3] == expect[:3] and torch.equal(got[3], expect[3])
    again = random.Random()
    again.setstate(back["pool_rng"])
    assert again.random() == pool_rng.random()
    assert back["pool"] == state["pool"] and back["ema_state"] == state["ema_state"]


def test_plain_state_converts_numpy_and_refuses_objects():
    from collections import deque

    from training.engine import checkpoint as C

    s = C.plain_state({"a": np.float32(0.5), "b": np.arange(3), "c": deque([np.int64(2)]), "t": (1, None)})
    assert s == {"a": 0.5, "b": [0, 1, 2], "c": [2], "t": (1, None)} and type(s["a"]) is float
    with pytest.raises(TypeError, match=r"state\['pool'\]\[0\] is a object"):
        C.plain_state({"pool": [object()]})


def test_a_legacy_client_state_is_refused_unless_trusted(tmp_path, monkeypatch):
    """Files from before this change hold numpy's RNG tuple: not loaded silently, loadable on request."""
    from training.engine import checkpoint as C

    np.random.seed(4)
    legacy = {"step": 1, "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}
    want = np.random.rand()
    torch.save(legacy, tmp_path / "old.pt")
    with pytest.raises(RuntimeError, match="SSP_TRUST_CHECKPOINT=1"):
        C.read_client_state(tmp_path / "old.pt")
    monkeypatch.setenv("SSP_TRUST_CHECKPOINT", "1")
    C.set_rng_state(C.read_client_state(tmp_path / "old.pt")["rng"])
    assert np.random.rand() == want


def test_shard_writer_streams_tensors_in_any_order_into_valid_safetensors(tmp_path):
    """The hand-laid-out headers: mixed dtypes (bf16 after fp32, int64, a scalar, an empty tensor),
    written in a shuffled order, read back by the safetensors library itself."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file

    from training.engine import hf_export as H

    g = torch.Generator().manual_seed(0)
    sd = {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(33, 7, generator=g).bfloat16(),
          "c.idx": torch.arange(17), "d.scale": torch.tensor(0.5), "e.empty": torch.zeros(0, 4),
          "f.half": torch.randn(5, generator=g).half(), "g.mask": torch.rand(9, generator=g) > 0.5}
    metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
    plan = split_torch_state_dict_into_shards(metas, filename_pattern="model{suffix}.safetensors", max_shard_size=4000)
    assert plan.is_sharded
    w = H._ShardWriter(tmp_path, plan.filename_to_tensors, metas)
    for k in random.Random(1).sample(sorted(sd), len(sd)):
        w.write(k, sd[k])
    w.close()
    back = {k: v for f in plan.filename_to_tensors for k, v in load_file(str(tmp_path / f)).items()}
    assert back.keys() == sd.keys()
    assert all(back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(RuntimeError, match="planned as"):
        H._ShardWriter(tmp_path, plan.filename_to_tensors, metas).write("a.weight", torch.zeros(2))


# ----------------------------------------------------------------------------- killed mid-save

@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_run_killed_during_a_checkpoint_write_resumes_from_the_previous_one(workdir, tiny_model_dir):  # noqa: F811
    from safetensors.torch import load_file

    out = workdir / "run_killed"
    root = out / "checkpoints"
    args = _args(workdir, tiny_model_dir, out) + ["--max_ckpts", "2"]
    rc = _torchrun(args, workdir / "k1.log", SSP_FAULT="in_save:2")
    log = (workdir / "k1.log").read_text()
    assert rc != 0 and "SSP_FAULT: killing rank" in log and "at in_save of step 2" in log, log[-4000:]
    # the write of checkpoint 2 was cut off: not committed, known as this run's, DeepSpeed's shards missing
    assert (root / "latest").read_text().strip() == "step_000001"
    half = root / "step_000002"
    assert (half / "run_id").read_text() == (root / "run_id").read_text()
    assert not list(half.glob("*model_states.pt"))
    # a folder the user copied in: rotation must leave it alone
    (root / "step_000000").mkdir()
    (root / "step_000000/notes.txt").write_text("mine")

    rc = _torchrun(args + ["--sample_every", "2"], workdir / "k2.log")
    log = (workdir / "k2.log").read_text()
    assert rc == 0, log[-4000:]
    assert f"resumed from {root / 'step_000001'} at step 1" in log
    assert "operational fields changed since the last launch: logging.sample_every 1 -> 2" in log
    assert (root / "latest").read_text().strip() == "step_000003"
    # max_ckpts 2 rotated this run's step 1 away; the user's folder is untouched
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000000", "step_000002", "step_000003"]
    assert (root / "step_000000/notes.txt").read_text() == "mine"
    # step 2, replayed from checkpoint 1, equals the step 2 the killed run logged
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 2, 3]
    assert _stable(rows[2]) == pytest.approx(_stable(rows[1]), rel=1e-6, abs=1e-7)
    # the final state loads: client states with weights_only, ZeRO shards into the weights of the HF export
    for tag in ("step_000002", "step_000003"):
        for r in (0, 1):
            st = torch.load(root / tag / f"trainer_rank{r}.pt", weights_only=True)
            assert st["step"] == int(tag[-1]) and st["world_size"] == 2 and isinstance(st["rng"]["numpy"], dict)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    zero = get_fp32_state_dict_from_zero_checkpoint(str(root), tag="step_000003")
    hf = load_file(str(root / "step_000003/hf/model.safetensors"))
    assert set(hf) <= set(zero)
    assert all(torch.equal(zero[k], hf[k]) for k in hf)


# ----------------------------------------------------------------------------- sharded HF export

MAX_SHARD = 300_000  # bytes; the tiny model's layers are ~0.6 MB: several shards, and the 25 MB embedding alone


def export_worker(out: Path, model: Path) -> None:
    """torchrun worker: ZeRO-3 actor on the tiny model, one optimizer step (so the weights are not
    the source file's), the sharded export, and rank 0's reference copy of the same weights
    gathered whole."""
    from utils.dist import prepare_launch_env

    prepare_launch_env()
    from utils import dist as D

    D.init_distributed()
    import deepspeed
    from safetensors.torch import save_file

    from training.engine import hf_export as H
    from training.settings.config import Config
    from training.engine.engine_builder import build_engines

    cfg = Config()
    cfg.model.model_path, cfg.model.dtype, cfg.model.gradient_checkpointing = str(model), "fp32", False
    cfg.optimisation.lr = 1e-2
    actor = build_engines(cfg).actor
    ids = (torch.arange(1, 49)[None] * 37) % 5000
    actor.backward(actor(input_ids=ids, labels=ids, use_cache=False).loss)
    actor.step()
    H.export_hf(actor.module, model, out / "hf", max_shard_size=MAX_SHARD)
    params = list(actor.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        if D.is_main():
            save_file({n: p.data.clone() for n, p in params}, str(out / "reference.safetensors"))
    # odd sizes (7 x 3 = 21 and 3 elements over 2 ranks): the last partition is padded, and the
    # gather to rank 0 must cut the padding off, in fp32 and bf16 alike
    odd = {}
    for dtype in (torch.float32, torch.bfloat16):
        with deepspeed.zero.Init(config_dict_or_path=actor.config, dtype=dtype):
            lin = torch.nn.Linear(7, 3)
        for name, p in lin.named_parameters():
            assert p.ds_tensor.numel() * 2 > p.ds_numel, "partitioned, the last partition padded"
            got = H._gather_to_main(p)
            with deepspeed.zero.GatheredParameters([p]):
                if D.is_main():
                    odd[f"{dtype}_{name}"] = bool(torch.equal(got, p.data)) and got.shape == p.shape
    if D.is_main():
        (out / "odd.json").write_text(json.dumps(odd))
    D.barrier()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_export_round_trips_through_from_pretrained_and_vllm(tmp_path, tiny_model_dir):
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    out.mkdir()
    rc = _torchrun([str(Path(__file__).relative_to(REPO)), "export", str(out), str(tiny_model_dir)], tmp_path / "w.log",
                   PYTHONPATH=str(REPO))
    if rc != 0:  # the cause first: a CI summary may cut the middle of a long message
        log = (tmp_path / "w.log").read_text()
        cause = [x for x in log.splitlines() if re.search(r"Error|error:|terminate|Abort|what\(\)", x)][:12]
        pytest.fail(f"export worker exit {rc}; first error lines:\n" + "\n".join(cause) + "\n--- tail:\n" + log[-3000:])
    odd = json.loads((out / "odd.json").read_text())
    assert len(odd) == 4 and all(odd.values()), odd
    hf = out / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(hf.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and not (hf / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    ref = load_file(str(out / "reference.safetensors"))
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    for p in shards:  # each file is valid safetensors, within the limit unless it is one big tensor
        with safe_open(str(p), "pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == p.name for k in keys)
            size = sum(f.get_tensor(k).numel() * 4 for k in keys)
        assert size <= MAX_SHARD or len(keys) == 1

    # from_pretrained: the same weights bit for bit, so the same logits as the source (trained) weights
    exp = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    orig = {k: v.clone() for k, v in src.state_dict().items()}
    src.load_state_dict(ref, strict=False)
    assert all(torch.equal(exp.state_dict()[k], ref[k]) for k in ref)
    assert any(not torch.equal(orig[k], ref[k]) for k in ref)  # the step moved the weights
    ids = torch.tensor([[1, 400, 2000, 37, 9, 4001, 17, 250]])
    with torch.no_grad():
        assert torch.equal(exp(ids).logits, src(ids).logits)

    # vLLM (CPU, fp32, greedy) serves the sharded folder and agrees with HF on the source weights
    from inference.engine_api import SamplingConfig
    from inference.engines import VLLMEngine
    from inference.hf_engine import HFEngine

    llm = VLLMEngine(hf, dtype="float32", seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    tok = llm.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Georges Bizet wrote the opera")]
    sp = SamplingConfig(temperature=0.0, max_tokens=12, min_tokens=12)
    got, want = llm.generate(prompts, sp), HFEngine(src, tokenizer=tok).generate(prompts, sp)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


if __name__ == "__main__" and sys.argv[1:2] == ["export"]:
    export_worker(Path(sys.argv[2]), Path(sys.argv[3]))
