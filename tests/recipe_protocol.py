"""The rollout protocol a training script runs, read off the script itself, and the check that a demo mix fits it
(issue 31: demos a rollout under the protocol could never write taught the proposer to run out of turns)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dataprep.protocol import Protocol

REPO = Path(__file__).resolve().parent.parent
FLAGS = {"--max_turns": "max_turns", "--max_tokens_per_turn": "max_tokens_per_turn",
         "--max_info_tokens": "max_info_tokens", "--min_searches": "min_searches",
         "--min_question_words": "min_question_words"}


def script_text(script: str | Path) -> str:
    """A script's text followed by that of each scripts/*.sh it sources (scripts/recipe.sh), comment lines left out."""
    text = Path(script).read_text()
    for name in re.findall(r"^\s*(?:source|\.)\s+\S*?([\w.-]+\.sh)\b", text, re.M):
        if (REPO / "scripts" / name).is_file() and name != Path(script).name:
            text += "\n" + (REPO / "scripts" / name).read_text()
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def script_protocol(script: str | Path) -> Protocol:
    """The protocol of a training script's RL run at its defaults: each flag's first value in the script or a
    script it sources, a "$VAR" replaced by their `VAR=${VAR:-default}`. A flag they never pass is an error."""
    text = script_text(script)
    defaults = dict(re.findall(r"^\s*([A-Z_]+)=\$\{\1:-([^}]*)\}", text, re.M))
    got = {}
    for flag, field in FLAGS.items():
        m = re.search(re.escape(flag) + r"\s+\"?\$?\{?([A-Z_]+|\d+)\}?\"?", text)
        assert m, f"{script} never passes {flag}"
        v = m.group(1)
        got[field] = int(defaults[v] if v in defaults else v)
    return Protocol(**got)


def sft_protocol(script: str | Path = REPO / "scripts" / "sft_coldstart.sh") -> Protocol:
    """The protocol scripts/sft_coldstart.sh builds the demo mix for, at its defaults."""
    text = Path(script).read_text()
    d = dict(re.findall(r"^\s*(SFT_[A-Z_]+)=\$\{\1:-([^}]*)\}", text, re.M))
    return Protocol(int(d["SFT_MAX_TURNS"]), int(d["SFT_MAX_TOKENS_PER_TURN"]), int(d["SFT_MAX_INFO_TOKENS"]),
                    int(d["SFT_MIN_SEARCHES"]), int(d["SFT_MIN_QUESTION_WORDS"]))


def misfits(mix: Path, proto: Protocol, tokenizer) -> list[str]:
    """Every demo of `mix` that a rollout under `proto` could not write, counted with the tokenizer directly."""
    bad = []
    for line in Path(mix).read_text().splitlines():
        d = json.loads(line)
        turns = [t["text"] for t in d["turns"] if t["kind"] == "model"]
        longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in turns)
        searches = sum(t["kind"] == "info" for t in d["turns"])
        if len(turns) > proto.max_turns or longest > proto.max_tokens_per_turn or (
                d["role"] == "proposer" and not proto.min_searches <= searches <= proto.max_searches):
            bad.append(f"{d['role']} {d.get('source')}: {len(turns)} turns, longest {longest} tokens, {searches} searches")
    return bad
