"""Settings dataclasses turned into argparse flags: one dataclass field = one flag, with one name, one
default, one help text and its choices (`F` puts them on the field). train.py, eval.py and sft.py build
their parsers from the same fields (`add_field_flags`, `parser_for`), so no flag is declared twice.
Knows no group: training/settings/config.py lists them (GROUPS)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any, Sequence, get_type_hints


def F(default, help: str, choices=None, aliases: tuple[str, ...] = (), **kw):  # noqa: A002 - mirrors argparse's name
    """A dataclass field that carries its --help text (and choices, and other spellings of its flag) as metadata."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if aliases:
        meta["aliases"] = tuple(aliases)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def derive_group(cls: type, name: str, keep: Sequence[str] | None = None, **defaults: Any) -> type:
    """Another entry point's group made from cls's declarations: the fields named in `keep` (all when None), each
    with the help, choices and spellings it is declared with, and the defaults given here. With every field kept it
    subclasses cls, so the group's own check() still holds. So sft.py's flags are train.py's, with its defaults."""
    hints = get_type_hints(cls)
    specs = []
    for f in fields(cls):
        if keep is not None and f.name not in keep:
            continue
        default = defaults.pop(f.name) if f.name in defaults else (
            f.default if f.default is not MISSING else f.default_factory())  # type: ignore[misc]
        specs.append((f.name, hints[f.name], F(default, f.metadata["help"], f.metadata.get("choices"),
                                               f.metadata.get("aliases", ()))))
    if defaults:
        raise TypeError(f"derive_group: {cls.__name__} has no field {', '.join(sorted(defaults))}")
    return make_dataclass(name, specs, bases=() if keep is not None else (cls,))


def parse_bool(s: str) -> bool:
    v = str(s).lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")


def field_flag(f, typ) -> tuple[list[str], dict[str, Any]]:
    """The flag names and argparse keywords of one dataclass field (its one name, default, help and choices)."""
    # argparse %-formats help text: a literal "30%" made --help crash.
    kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "").replace("%", "%%")}
    if typ is bool:
        kw.update(type=parse_bool, metavar="BOOL")
    else:
        kw["type"] = typ
    if "choices" in f.metadata:
        kw["choices"] = f.metadata["choices"]
    names = [f"--{f.name}", *f.metadata.get("aliases", ())]
    if f.name == "local_rank":
        names.append("--local-rank")  # torch.distributed.launch / deepspeed spelling
    return names, kw


def add_field_flags(g, cls, names: Sequence[str], dests: dict[str, str] | None = None,
                    aliases: dict[str, tuple[str, ...]] | None = None, metavars: dict[str, str] | None = None) -> None:
    """Add train.py's flags for the fields `names` of group `cls` to the parser (or group) `g`: same name,
    default, help and choices, so another entry point (eval.py) declares none of them again. `dests`,
    `aliases` and `metavars` give that entry point its own attribute names, extra spellings and metavars."""
    by_name, hints = {f.name: f for f in fields(cls)}, get_type_hints(cls)
    for name in names:
        flags, kw = field_flag(by_name[name], hints[name])
        if name in (metavars or {}):
            kw["metavar"] = metavars[name]
        g.add_argument(*flags, *(aliases or {}).get(name, ()), dest=(dests or {}).get(name, name), **kw)


def parser_for(groups: dict, description: str = "") -> argparse.ArgumentParser:
    """One flag per field of the given dataclass groups ({group name: dataclass}), one --help section per group."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for gname, cls in groups.items():
        g = p.add_argument_group(gname)
        add_field_flags(g, cls, [f.name for f in fields(cls)])
    return p


def groups_from_namespace(groups: dict, ns: argparse.Namespace) -> dict:
    """{group name: that dataclass, filled from the parsed flags} (every field's flag has its field's name as dest)."""
    return {g: cls(**{f.name: getattr(ns, f.name) for f in fields(cls)}) for g, cls in groups.items()}
