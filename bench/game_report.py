"""What the self-play game played in some training runs, side by side: one table row per run, read off each run's
metrics.jsonl (the game's counts, inference/game_metrics.py) and its config.json. Issue 31 uses it to record the
diagnosis run of the old recipe and every setting tried on the way to a live game.

    python bench/game_report.py --section learning_game_settings --note "why these runs" \\
        --run "old recipe=runs/diag/seed1" --run "rag policy, 1-acc=runs/tune/t1"
    python bench/game_report.py --keep --note "..." --run "sweep A seed 101=runs/learning_protocol/sweep_A_seed101"

--keep adds rows to the section's table and keeps those it holds (issue 41's sweep beside issue 31's settings); each
row names the commit its run recorded.

Every share is a ratio of counts summed over the run's steps (a step with more games weighs more), so it is
the share of all the run's groups, questions or rollouts, not a mean of per-step shares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.learning_common import NAN, fmt_num, read_metrics  # noqa: E402
from bench import report  # noqa: E402
from bench.report import md_table, write_results  # noqa: E402

NO_QUESTION = ("turn_cap", "total_cap", "out_of_turns", "eos", "no_action", "empty")
FILTERS = ("no_question", "too_short", "too_long", "too_few_words", "answer_in_question", "too_few_searches",
           "empty_retrieval", "rag_failed")


def summarise(run: Path) -> dict:
    """The run's game over all its training steps: shares of summed counts, and the recipe that played it."""
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        sys.exit(f"game_report.py: {run}/metrics.jsonl holds no training step")
    tot = {}
    for r in rows:
        for k, v in r.items():
            if isinstance(v, (int, float)):
                tot[k] = tot.get(k, 0.0) + float(v)

    def share(num: str, den: str) -> float:
        return tot.get(num, 0.0) / tot[den] if tot.get(den) else NAN

    props = tot.get("game/proposer_trajs", 0.0)
    fresh = sum(tot.get(f"game/fresh_{k}", 0.0) for k in ("s0", "mid", "s1"))
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    sp = cfg.get("selfplay", {})
    return {
        "steps": len(rows),
        "recipe": (f"rag {sp.get('rag_verify', '?')}, {sp.get('proposer_reward', '?')}, penalty "
                   f"{sp.get('format_penalty', '?')}, pool s in [{sp.get('pool_min_solve_rate', '-')}, "
                   f"{sp.get('pool_max_solve_rate', '-')}]"
                   + (f", shortcut filter {sp['shortcut_filter']}" if "shortcut_filter" in sp else "")
                   + (f", rounds <= {sp['max_rounds']} until {sp['min_informative_groups']} informative groups"
                      if (sp.get("max_rounds") or 1) > 1 else "")),
        "proposer_trajs": props,
        "valid_rate": share("game/valid_questions", "game/proposer_trajs"),
        "informative_share": share("game/informative_groups", "game/solver_groups"),
        "informative_share_fresh": share("game/informative_groups/fresh", "game/solver_groups/fresh"),
        # per proposer slot, the empty ones counted (game_metrics' game/informative_per_slot): fresh groups, then all
        "informative_per_slot": share("game/informative_groups/fresh", "game/solver_slots"),
        "informative_per_slot_all": share("game/informative_groups", "game/solver_slots"),
        "valid_rate_by_kind": {k: share(f"game/valid_questions/{k}", f"game/proposer_trajs/{k}") for k in
                               sorted(k[len("game/proposer_trajs/"):] for k in tot if k.startswith("game/proposer_trajs/"))},
        "fresh_acc": share("solver/fresh_correct", "solver/fresh_trajs"),
        "fresh_questions": fresh,
        **{f"fresh_{k}": (tot.get(f"game/fresh_{k}", 0.0) / fresh if fresh else NAN) for k in ("s0", "mid", "s1")},
        **{f"filter/{k}": (tot.get(f"game/filter/{k}", 0.0) / props if props else NAN) for k in FILTERS},
        **{f"no_question/{k}": tot.get(f"game/no_question/{k}", 0.0) for k in NO_QUESTION},
        "valid_doc1_title": share("game/valid_doc1_title", "game/valid_questions"),
        "valid_answer_in_text": share("game/valid_answer_in_text", "game/valid_questions"),
        "valid_one_search": share("game/valid_one_search", "game/valid_probed"),
        "pool_repeats": share("game/pool_repeats", "game/pool_fills"),
        "pool_served_acc": share("game/pool_served_correct", "game/pool_served_trajs"),
        "proposer_reward": tot.get("proposer/reward_mean", 0.0) / len(rows),
        # the dev split (training distribution, never a held-out set) at the run's last step, where it was scored
        "dev_em": dev_em(run),
        "commit": run_commit(run),
    }


def run_commit(run: Path) -> str | None:
    """The commit the run's first launch ran (run_meta.jsonl, scripts/learning_proof_cpu.sh); None where not recorded."""
    meta = run / "run_meta.jsonl"
    lines = meta.read_text().splitlines() if meta.exists() else []
    return json.loads(lines[0]).get("commit") if lines else None


def dev_em(run: Path) -> float:
    """EM % on the dev split at the run's last step: run/dev (a tuning run) or the ladder's run/dev_step<N>."""
    found = [f for f in [run / "dev" / "results.json"] + sorted(run.glob("dev_step*/results.json"),
             key=lambda f: int(f.parent.name[len("dev_step"):]), reverse=True) if f.exists()]
    return 100 * json.loads(found[0].read_text())["overall"]["em"] if found else NAN


def kept_rows(section_name: str, new_labels: set[str]) -> list[tuple[str, dict]]:
    """The rows results.json already holds for the section, less those being re-run; a row written before rows
    carried their commit gets the section's stamp."""
    data = json.loads(report.RESULTS_JSON.read_text()) if report.RESULTS_JSON.exists() else {}
    stamp = data.get(report.SECTIONS_KEY, {}).get(section_name, {}).get("commit")
    rows = []
    for key, s in data.items():
        label = key[len(section_name) + 1:]
        if key.startswith(section_name + ".") and isinstance(s, dict) and label not in new_labels:
            rows.append((label, {**s, "commit": s.get("commit") or stamp}))   # its shares as stored (None: no denominator)
    md = report.RESULTS_MD.read_text() if report.RESULTS_MD.exists() else ""
    at = {label: md.find(f"\n| {label} |") for label, _ in rows}           # the table's own order; new ones last
    return sorted(rows, key=lambda r: (at[r[0]] < 0, at[r[0]]))


def section(runs: list[tuple[str, Path]], kept: list[tuple[str, dict]] = ()) -> tuple[dict, str]:
    got = list(kept) + [(label, summarise(path)) for label, path in runs]
    cols = [("steps", "steps", "d"), ("valid rate", "valid_rate", ".2f"),
            ("valid rate by answer kind", None, None),
            ("informative share", "informative_share", ".2f"),
            ("informative groups per slot: fresh / all", None, None), ("fresh-question acc", "fresh_acc", ".3f"),
            ("fresh s=0 / 0<s<1 / s=1", None, None), ("no question", "filter/no_question", ".2f"),
            ("no question: turn cap / out of turns", None, None),
            ("too few searches", "filter/too_few_searches", ".2f"), ("answer in question", "filter/answer_in_question", ".2f"),
            ("too few words", "filter/too_few_words", ".2f"), ("RAG refused", "filter/rag_failed", ".2f"),
            ("valid: answer = Doc-1 title", "valid_doc1_title", ".2f"), ("valid: answer in page text", "valid_answer_in_text", ".2f"),
            ("valid: one search of the question finds it", "valid_one_search", ".2f"),
            ("pool fills that repeat one", "pool_repeats", ".2f"), ("pool-served acc", "pool_served_acc", ".3f"),
            ("dev EM % at the last step", "dev_em", ".1f"), ("commit", None, None)]
    rows = []
    for label, s in got:
        row = [label, s["recipe"]]
        for name, key, fmt in cols:
            if key is not None:
                row.append(str(s[key]) if fmt == "d" else fmt_num(s.get(key), fmt))
            elif name.startswith("fresh s=0"):
                row.append(" / ".join(fmt_num(s[f"fresh_{k}"], ".2f") for k in ("s0", "mid", "s1")))
            elif name.startswith("no question"):
                row.append(f"{s['no_question/turn_cap']:.0f} / {s['no_question/out_of_turns']:.0f}")
            elif name.startswith("valid rate by"):
                kinds = s.get("valid_rate_by_kind")
                row.append(", ".join(f"{k} {fmt_num(_num(v), '.2f')}" for k, v in kinds.items())
                           if isinstance(kinds, dict) and kinds else "-")
            elif name.startswith("informative groups per slot"):
                row.append(f"{fmt_num(s.get('informative_per_slot'), '.2f')} / "
                           f"{fmt_num(s.get('informative_per_slot_all'), '.2f')}")
            else:
                row.append(f"`{s['commit'][:10]}`" if s.get("commit") else "-")
        rows.append(row)
    table = md_table(["run", "recipe"] + [c for c, _, _ in cols], rows)
    keys = {f"{label}": _nan_to_none(s) for label, s in got}
    return keys, table


def _num(v) -> float:
    return NAN if v is None else v


def _nan_to_none(v):
    """results.json holds no NaN: a share with no denominator is null."""
    if isinstance(v, dict):
        return {k: _nan_to_none(x) for k, x in v.items()}
    return None if isinstance(v, float) and v != v else v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=RUN_DIR",
                    help="a training run folder (metrics.jsonl, config.json) and the label of its row")
    ap.add_argument("--section", default="learning_game_settings", help="the RESULTS.md section and results.json prefix")
    ap.add_argument("--note", default="", help="what the runs are, above the table")
    ap.add_argument("--keep", action="store_true",
                    help="keep the rows the section already holds in results.json (a row re-run under its label is "
                         "replaced); each row names the commit it ran")
    a = ap.parse_args(argv)
    runs = []
    for spec in a.run:
        label, sep, path = spec.partition("=")
        if not sep or not label.strip() or not path.strip():
            ap.error(f"--run {spec!r}: give LABEL=RUN_DIR")
        runs.append((label.strip(), Path(path.strip())))
    per_run, table = section(runs, kept_rows(a.section, {label for label, _ in runs}) if a.keep else [])
    md = (f"{a.note.strip()}\n\n" if a.note.strip() else "") + (
        "Shares are of counts summed over each run's steps (inference/game_metrics.py): valid rate = valid questions "
        "over proposer rollouts (by answer kind: of that kind's rollouts); informative share = solver groups whose "
        "rewards are not all equal; informative groups per slot = those groups over proposer slots, the empty slots "
        "counted (fresh: from this step's own questions; all: pool replays too); the filter "
        "columns are shares of proposer rollouts refused for that reason; the valid-question kinds are shares of "
        "valid questions.\n\n" + table + "\n")
    write_results(a.section, {f"{a.section}.{k}": v for k, v in per_run.items()}, md,
                  measures=["inference/game.py", "inference/game_metrics.py", "inference/rag_check.py", "dataprep"])
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
