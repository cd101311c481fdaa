"""Issue 41's sweep, as the protocol fixes it (bench/learning_protocol.json, "sweep"): three stages, each keeping the
candidate with the highest dev-split EM (eval.py's, at the sweep's step, mean over the sweep's seeds); a tie goes to
the candidate listed first, the incumbent. It reads the protocol and the runs already finished, and says what runs
next. scripts/learning_sweep_cpu.sh runs candidate after candidate with it until the sweep has chosen.

    python -m bench.learning_sweep --out runs/learning_protocol      # shell assignments: the next candidate, or CHOSEN
    python -m bench.learning_sweep --out runs/learning_protocol --amend   # write the choice into the protocol file

--amend makes the one amendment the protocol allows once the sweep has chosen: the chosen flags into arms.ssp.flags
(and the status line), and, if candidate E was chosen (more than one round a step), the SSP milestone
round(30 x t_ref / t_E) with the distill milestone scaled alike (exchange_rate.multi_round), t the median
timing_s/step of the sweep's runs of E and of the candidate it beat. It edits those lines of the file's text and
nothing else, and refuses a protocol already amended; commit the file on its own.

Stage 1's candidates are the protocol's flags as written. A later stage's challenger is built from the winner so far,
as the protocol words it: D = the winner's flags with --shortcut_filter both, E = the winner's flags with the full-slots
flags. The protocol's text is checked to still say so, so an edited protocol cannot be run by stale rules.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.learning_compare import load_protocol  # noqa: E402

SHORTCUT_BOTH = "--shortcut_filter both"
FULL_SLOTS = "--min_informative_groups 4 --max_rounds 2 --drop_flat_solver_groups true"


def challenger(label: str, text: str, winner_flags: str) -> str:
    """A later stage's challenger's flags, from the winner so far and the protocol's words for it."""
    if SHORTCUT_BOTH in text:
        if "--shortcut_filter off" not in winner_flags:
            raise ValueError(f"candidate {label}: the winner's flags {winner_flags!r} set no --shortcut_filter off")
        return winner_flags.replace("--shortcut_filter off", SHORTCUT_BOTH)
    if FULL_SLOTS in text:
        return f"{winner_flags} {FULL_SLOTS}"
    raise ValueError(f"candidate {label}: {text!r} is neither rule this sweep knows ({SHORTCUT_BOTH!r}, {FULL_SLOTS!r})")


def dev_em(out: Path, label: str, seed: int, steps: int) -> float | None:
    """EM (0-1) of sweep candidate `label`'s seed at the sweep's step on the dev split; None until it is there."""
    f = out / f"sweep_{label}_seed{seed}" / f"dev_step{steps}" / "results.json"
    return float(json.loads(f.read_text())["overall"]["em"]) if f.exists() else None


def plan(proto: dict, out: Path) -> dict:
    """{"next": (label, flags) or None, "chosen": (label, flags) or None, "stages": [{label: (flags, score)}]}."""
    sw = proto["sweep"]
    seeds, steps = sw["seeds"], sw["steps"]
    stages, winner = [], None
    for st in sw["stages"]:
        cands: dict[str, str] = {}
        for label, text in st["candidates"].items():
            if label.startswith("winner of"):
                if winner is None:
                    raise ValueError(f"stage {st['stage']} names {label!r} before any stage has a winner")
                cands[winner[0]] = winner[1]
            elif winner is None:
                cands[label] = text
            else:
                cands[label] = challenger(label, text, winner[1])
        scored = {}
        for label, flags in cands.items():
            ems = [dev_em(out, label, s, steps) for s in seeds]
            if any(e is None for e in ems):
                stages.append({k: (f, None) for k, f in cands.items()})
                return {"next": (label, flags), "chosen": None, "stages": stages}
            scored[label] = (flags, round(sum(ems) / len(ems), 9))   # rounded: equal EM counts tie exactly
        stages.append(scored)
        best = max(scored.values(), key=lambda fs: fs[1])[1]
        label = next(k for k, (_, sc) in scored.items() if sc == best)   # listed first: the incumbent wins a tie
        winner = (label, scored[label][0])
    return {"next": None, "chosen": winner, "stages": stages}


def median_step_s(out: Path, label: str, seeds: list[int]) -> tuple[float, int]:
    """(median timing_s/step over the training steps of candidate `label`'s sweep runs, how many steps)."""
    xs = [json.loads(line)["timing_s/step"] for s in seeds
          for line in (out / f"sweep_{label}_seed{s}" / "metrics.jsonl").read_text().splitlines()
          if line.strip() and "timing_s/step" in json.loads(line)]
    if not xs:
        raise ValueError(f"candidate {label}'s runs in {out} log no timing_s/step")
    return statistics.median(xs), len(xs)


def amend(protocol: Path, out: Path) -> str:
    """Write the sweep's choice into the protocol file (see the module's docstring); returns what was done."""
    text = protocol.read_text()
    proto = json.loads(text)
    if proto["arms"]["ssp"].get("flags"):
        raise ValueError(f"arms.ssp.flags is set already ({proto['arms']['ssp']['flags']!r}): the protocol was amended")
    p = plan(proto, out)
    if p["chosen"] is None:
        raise ValueError(f"the sweep has not chosen yet: candidate {p['next'][0]} runs next")
    label, flags = p["chosen"]
    subs = [('"flags": null,', f'"flags": {json.dumps(flags)},')]
    said = [f"chose {label}: {flags}"]
    status = proto.get("status")
    if status:
        subs.append((json.dumps(status), json.dumps(f"amended once: the sweep chose candidate {label}; "
                                                    "no primary run has run")))
    if FULL_SLOTS in flags:   # more rounds a step: SSP keeps its training minutes (exchange_rate.multi_round)
        ref = next(k for k in p["stages"][-1] if k != label)
        seeds = proto["sweep"]["seeds"]
        (t_e, n_e), (t_r, n_r) = median_step_s(out, label, seeds), median_step_s(out, ref, seeds)
        ms = proto["milestones"]
        new = {"ssp": round(ms["ssp"] * t_r / t_e), "distill": round(ms["distill"] * t_r / t_e)}
        for k, v in new.items():
            subs.append((f'"{k}": {ms[k]}', f'"{k}": {v}'))
        said.append(f"median timing_s/step {t_e:.1f} s over {n_e} steps of {label} against {t_r:.1f} s over {n_r} of "
                    f"{ref}: milestones ssp {ms['ssp']} -> {new['ssp']}, distill {ms['distill']} -> {new['distill']}")
    for old, repl in subs:
        if text.count(old) != 1:
            raise ValueError(f"{protocol}: {old!r} is not in the file exactly once; amend it by hand")
        text = text.replace(old, repl)
    assert json.loads(text)["arms"]["ssp"]["flags"] == flags
    protocol.write_text(text)
    return "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/learning_protocol"), help="the runs' folder (OUT)")
    ap.add_argument("--protocol", type=Path, default=REPO / "bench" / "learning_protocol.json")
    ap.add_argument("--amend", action="store_true", help="write the sweep's choice into the protocol file")
    a = ap.parse_args(argv)
    proto = load_protocol(a.protocol)
    if proto is None:
        sys.exit(f"learning_sweep: {a.protocol} is missing")
    if a.amend:
        try:
            print(f"learning_sweep: {a.protocol}: {amend(a.protocol, a.out)}")
        except (KeyError, ValueError) as e:
            sys.exit(f"learning_sweep: {a.protocol}: {e}")
        return 0
    try:
        p = plan(proto, a.out)
    except (KeyError, ValueError) as e:
        sys.exit(f"learning_sweep: {a.protocol}: {e}")
    for i, st in enumerate(p["stages"], 1):
        print(f"# stage {i}: " + ", ".join(f"{k} {'-' if sc is None else f'{100 * sc:.1f}'}" for k, (_, sc) in st.items()),
              file=sys.stderr)
    sw = proto["sweep"]
    label, flags = p["next"] or p["chosen"]
    vals = {"SEEDS": " ".join(map(str, sw["seeds"])), "STEPS": sw["steps"], "DEV_EVERY": proto.get("dev_every", 0),
            "LABEL": label, "FLAGS": flags, "CHOSEN": "1" if p["chosen"] else "0"}
    print("\n".join(f"{k}={shlex.quote(str(v))}" for k, v in vals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
