"""training/engine/run_state.py: a damaged checkpoint is refused naming its file, the newest complete one is offered by
name, no hint deletes checkpoints without saying so, and the dry run's verdict on a run folder writes nothing."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from training.engine import run_state as S


def _cfg(**changes) -> dict:
    from training.settings.config import Config

    d = Config().to_dict()
    for key, value in changes.items():
        group, name = key.split("__")
        d[group][name] = value
    return d


def _ckpt(root: Path, step: int, files=("trainer_rank0.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")) -> Path:
    """A checkpoint folder whose .pt files are whole zips, as torch.save writes them."""
    path = root / S.tag_for(step)
    path.mkdir(parents=True)
    (path / "run_id").write_text("r1\n")
    for f in files:
        with zipfile.ZipFile(path / f, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 2000)
    return path


def _run(tmp_path: Path, steps=(10, 20), latest: str | None = "step_000020") -> Path:
    out = tmp_path / "run"
    root = out / "checkpoints"
    for s in steps:
        _ckpt(root, s)
    (root / "run_id").write_text("r1\n")
    if latest:
        (root / "latest").write_text(latest + "\n")
    (out / "config.json").write_text(json.dumps(_cfg()))
    return out


def test_a_complete_checkpoint_resumes_and_a_damaged_one_names_its_file(tmp_path):
    out = _run(tmp_path)
    root = out / "checkpoints"
    assert S.find_resume(out, "auto") == root / "step_000020" and S.find_resume(out, "none") is None
    assert S.checkpoint_problems(root / "step_000020") == []
    pt = root / "step_000020/trainer_rank0.pt"
    pt.write_bytes(pt.read_bytes()[:300])  # a copy cut short: the zip lost its directory
    assert S.checkpoint_problems(root / "step_000020") == [
        "trainer_rank0.pt is truncated or damaged (300 bytes, not a whole torch file)"]
    with pytest.raises(S.ResumeError) as e:
        S.find_resume(out, "auto")
    msg = str(e.value)
    assert "latest names step_000020, which is incomplete: trainer_rank0.pt is truncated" in msg
    assert f"pass --resume {root / 'step_000010'} to continue from it" in msg
    assert "--overwrite true (it deletes this run's checkpoints" in msg   # never a deleting flag without saying so
    with pytest.raises(S.ResumeError, match=r"--resume .*step_000020: the checkpoint is damaged: trainer_rank0.pt"):
        S.find_resume(out, str(root / "step_000020"))
    assert S.find_resume(out, str(root / "step_000010")) == root / "step_000010"


def test_latest_naming_a_missing_step_offers_the_newest_complete_one(tmp_path):
    out = _run(tmp_path, latest="step_000030")
    root = out / "checkpoints"
    (root / "step_000020/zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()   # incomplete too
    with pytest.raises(S.ResumeError) as e:
        S.find_resume(out, "auto")
    msg = str(e.value)
    assert "latest names step_000030, which is missing" in msg and "newest complete checkpoint is step_000010" in msg
    # nothing complete left: starting over is offered with what it deletes, or another folder
    (root / "step_000010/trainer_rank0.pt").unlink()
    with pytest.raises(S.ResumeError, match="No complete checkpoint is left .*it deletes this run's checkpoints"):
        S.find_resume(out, "auto")
    (root / "latest").write_text("garbage\n")
    with pytest.raises(S.ResumeError, match="is damaged"):
        S.find_resume(out, "auto")


def test_resume_none_on_a_run_says_what_overwrite_deletes_and_offers_a_checkpoint(tmp_path):
    out = _run(tmp_path)
    before = sorted(str(p) for p in out.rglob("*"))
    v = S.output_dir_verdict(out, _cfg(checkpointing__resume="none"))
    assert "--resume auto to continue from step_000020" in v.refusal
    assert f"--resume {out / 'checkpoints/step_000020'} to continue from that checkpoint" in v.refusal
    assert "--overwrite true to start over here (it deletes this run's checkpoints, metrics.jsonl" in v.refusal
    # with a damaged latest the offer is the newest complete checkpoint, not --resume auto
    (out / "checkpoints/latest").write_text("step_000030\n")
    v = S.output_dir_verdict(out, _cfg(checkpointing__resume="none"))
    assert "--resume auto" not in v.refusal and "latest names step_000030, which is missing" in v.refusal
    assert str(out / "checkpoints/step_000020") in v.refusal
    assert sorted(str(p) for p in out.rglob("*")) == before  # read only: the dry run asks this too


def test_run_folder_errors_is_what_the_launch_refuses(tmp_path):
    out = _run(tmp_path, latest="step_000030")
    assert "another run" in S.run_folder_errors(out, _cfg(optimisation__lr=1.0))[0]
    assert "latest names step_000030, which is missing" in S.run_folder_errors(out, _cfg())[0]
    assert S.run_folder_errors(out, _cfg(checkpointing__resume=str(out / "checkpoints/step_000010"))) == []
    # --overwrite true starts over (the damaged checkpoints go first): nothing to resume, nothing to refuse
    assert S.run_folder_errors(out, _cfg(optimisation__lr=1.0, checkpointing__overwrite=True)) == []
    # the dry run leaves out --prompts_per_step when it was 0 (auto): the launch keeps the run's own
    (out / "config.json").write_text(json.dumps(_cfg(selfplay__prompts_per_step=8)))  # what the run resolved
    auto = _cfg(selfplay__prompts_per_step=0, checkpointing__resume=str(out / "checkpoints/step_000010"))
    assert "prompts_per_step" in S.run_folder_errors(out, auto)[0]
    assert S.run_folder_errors(out, auto, ignore=("selfplay.prompts_per_step",)) == []
    assert S.run_folder_errors(tmp_path / "fresh", _cfg()) == []


def test_checkpoint_read_of_a_truncated_client_state_names_the_file(tmp_path):
    """training/engine/checkpoint.py's torch.load of trainer_rank0.pt: '[Errno 22] Invalid argument' became a
    ResumeError that names the file, says the checkpoint is damaged and offers the newest complete one."""
    import torch

    from training.engine.checkpoint import read_client_state

    out = _run(tmp_path)
    pt = out / "checkpoints/step_000020/trainer_rank0.pt"
    torch.save({"step": 20}, pt)
    assert read_client_state(pt) == {"step": 20}
    pt.write_bytes(pt.read_bytes()[:200])
    with pytest.raises(S.ResumeError, match=r"trainer_rank0.pt cannot be read .* is damaged\. The newest complete "
                                            r"checkpoint is step_000010"):
        read_client_state(pt)
