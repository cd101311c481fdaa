"""bench/report.py: each section is stamped with the commit it measured, and --check names the
sections whose measured code changed since, on a real git repository in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import bench.report as report  # noqa: E402


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repo holding code/a.py and other.py, committed; its bench results live in repo/bench."""
    r = tmp_path / "repo"
    (r / "code").mkdir(parents=True)
    (r / "bench").mkdir()
    git(r, "init", "-q")
    git(r, "config", "user.email", "t@example.com")
    git(r, "config", "user.name", "t")
    (r / "code/a.py").write_text("x = 1\n")
    (r / "other.py").write_text("y = 1\n")
    git(r, "add", ".")
    git(r, "commit", "-q", "-m", "start")
    monkeypatch.setattr(report, "RESULTS_JSON", r / "bench/results.json")
    monkeypatch.setattr(report, "RESULTS_MD", r / "bench/RESULTS.md")
    return r


def commit(repo: Path, path: str, text: str) -> str:
    (repo / path).write_text(text)
    git(repo, "add", path)
    git(repo, "commit", "-q", "-m", f"change {path}")
    return git(repo, "rev-parse", "HEAD")


def write(repo: Path, section: str = "sync") -> None:
    report.write_results(section, {f"{section}.seconds": 1.5}, "a table", measures=["code/a.py"],
                         script="bench/bench_x.py", repo=repo)


def test_stamp_in_markdown_and_json_keeps_flat_keys(repo):
    head = git(repo, "rev-parse", "HEAD")
    write(repo)
    data = json.loads(report.RESULTS_JSON.read_text())
    assert data["sync.seconds"] == 1.5                                  # the flat keys are untouched
    s = data[report.SECTIONS_KEY]["sync"]
    assert s["commit"] == head and s["measures"] == ["code/a.py"] and s["script"] == "bench/bench_x.py"
    assert s["run"].endswith("UTC")
    md = report.RESULTS_MD.read_text()
    assert f"commit `{head[:10]}`._" in md.split("## sync")[1].splitlines()[2]   # the line under the heading
    assert report.stale_sections(repo=repo) == []


def test_change_to_measured_path_is_stale_unrelated_is_not(repo):
    measured = git(repo, "rev-parse", "HEAD")
    write(repo)
    commit(repo, "other.py", "y = 2\n")
    assert report.stale_sections(repo=repo) == []                       # unrelated file: still current
    new = commit(repo, "code/a.py", "x = 2\n")
    w = report.stale_sections(repo=repo)
    assert w == [(f"bench/RESULTS.md section 'sync' measured {measured[:10]}; code/a.py changed since in "
                  f"{new[:10]}: re-run bench/bench_x.py")]
    write(repo)                                                         # re-measured: current again
    assert report.stale_sections(repo=repo) == []


def test_same_code_by_another_history_is_current(repo):
    """A section measured on a branch that was then rebased (a commit not in HEAD's history, same code) is current
    until the measured code itself changes."""
    main = git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    git(repo, "checkout", "-q", "-b", "side")
    commit(repo, "code/a.py", "x = 2\n")
    write(repo)                                                         # measured on side
    git(repo, "checkout", "-q", main)
    commit(repo, "code/a.py", "x = 2\n")                                # the same change, another commit
    assert report.stale_sections(repo=repo) == []
    commit(repo, "code/a.py", "x = 3\n")
    (w,) = report.stale_sections(repo=repo)
    assert "code/a.py changed since in" in w


def test_folder_measure_and_dirty_stamp(repo):
    report.write_results("step", {}, "t", measures=["code"], script="bench/bench_y.py", repo=repo)
    assert report.stale_sections(repo=repo) == []
    (repo / "code/b.py").write_text("z = 1\n")                          # untracked file under a measured folder
    report.write_results("step", {}, "t", measures=["code"], script="bench/bench_y.py", repo=repo)
    s = json.loads(report.RESULTS_JSON.read_text())[report.SECTIONS_KEY]["step"]
    assert s["commit"].endswith("+dirty")
    assert "(uncommitted changes to the measured code)" in report.RESULTS_MD.read_text()
    (w,) = report.stale_sections(repo=repo)
    assert "section 'step' measured" in w and "+dirty, with uncommitted changes to code/b.py: re-run" in w
    assert s["dirty"] == ["code/b.py"]
    # a modified tracked file is named too (porcelain's " M path": the leading space is part of the format)
    (repo / "code/a.py").write_text("x = 5\n")
    report.write_results("step", {}, "t", measures=["code"], script="bench/bench_y.py", repo=repo)
    s = json.loads(report.RESULTS_JSON.read_text())[report.SECTIONS_KEY]["step"]
    assert sorted(s["dirty"]) == ["code/a.py", "code/b.py"]
    git(repo, "checkout", "code/a.py")
    # a dirty file elsewhere does not make the section dirty
    git(repo, "add", "code/b.py")
    git(repo, "commit", "-q", "-m", "b")
    (repo / "other.py").write_text("y = 3\n")
    report.write_results("step", {}, "t", measures=["code"], script="bench/bench_y.py", repo=repo)
    assert report.stale_sections(repo=repo) == []


def test_unstamped_section_and_foreign_commit_warn(repo):
    write(repo)
    # a section written by hand (or before stamps existed) has no commit
    md = report.RESULTS_MD.read_text() + "\n<!-- begin old -->\n## old\n\nx\n<!-- end old -->\n"
    report.RESULTS_MD.write_text(md)
    data = json.loads(report.RESULTS_JSON.read_text())
    data[report.SECTIONS_KEY]["sync"]["commit"] = "0" * 40              # a commit this repo does not hold
    report.RESULTS_JSON.write_text(json.dumps(data))
    w = report.stale_sections(repo=repo)
    assert len(w) == 2
    assert "section 'sync' measured 0000000000; its commit is not in this repository" in w[0]
    assert w[1] == "bench/RESULTS.md section 'old' has no recorded commit: re-run the bench that writes it"


def test_no_git_stamps_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_JSON", tmp_path / "results.json")
    monkeypatch.setattr(report, "RESULTS_MD", tmp_path / "RESULTS.md")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))      # tmp_path may sit inside some repo
    report.write_results("sync", {"sync.seconds": 1.0}, "t", measures=["a.py"], repo=tmp_path)
    assert json.loads(report.RESULTS_JSON.read_text())[report.SECTIONS_KEY]["sync"]["commit"] == "unknown"
    assert "commit `unknown`" in report.RESULTS_MD.read_text()
    assert report.stale_sections(repo=tmp_path) == [
        "RESULTS.md: git is unavailable here, so no section can be checked"]


def test_check_cli_warns_and_strict_fails(repo):
    write(repo)
    commit(repo, "code/a.py", "x = 3\n")
    # the CLI reads the real bench/, so call main() on the patched paths with the repo swapped in
    orig = report.REPO
    try:
        report.REPO = repo
        assert report.main(["--check"]) == 0
        assert report.main(["--check", "--strict"]) == 1
    finally:
        report.REPO = orig


def test_check_cli_runs_on_this_repo():
    """The real entry point: exit 0 whatever it finds (a warning, not a failure)."""
    p = subprocess.run([sys.executable, "bench/report.py", "--check"], check=False, cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
