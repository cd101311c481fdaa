"""Issue 41's sweep, as the protocol fixes it (bench/learning_protocol.json, "sweep"): three stages, each keeping the
candidate with the highest dev-split EM (eval.py's, at the sweep's step, mean over the sweep's seeds); a tie goes to
the candidate listed first, the incumbent. It reads the protocol and the runs already finished, and says what runs
next. scripts/learning_sweep_cpu.sh runs candidate after candidate with it until the sweep has chosen.

    python -m bench.learning_sweep --out runs/learning_protocol      # shell assignments: the next candidate, or CHOSEN

Stage 1's candidates are the protocol's flags as written. A later stage's challenger is built from the winner so far,
as the protocol words it: D = the winner's flags with --shortcut_filter both, E = the winner's flags with the full-slots
flags. The protocol's text is checked to still say so, so an edited protocol cannot be run by stale rules.
"""

from __future__ import annotations

import argparse
import json
import shlex
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/learning_protocol"), help="the runs' folder (OUT)")
    ap.add_argument("--protocol", type=Path, default=REPO / "bench" / "learning_protocol.json")
    a = ap.parse_args(argv)
    proto = load_protocol(a.protocol)
    if proto is None:
        sys.exit(f"learning_sweep: {a.protocol} is missing")
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
