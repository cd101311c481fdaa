"""Questions and clues read off Wikipedia text, for the cold-start demos (dataprep/coldstart.py) and the
reading facts (dataprep/facts.py): an article's sentences, the clues about its subject that they give, the
question written from those clues, and the description phrased as "the <description>".

    sentences("Betelgeuse (from Arabic) is a red supergiant star ... It is usually the tenth-brightest star ...")
    article_clues(text, "Betelgeuse", ["Betelgeuse"])  # ["a red supergiant star ...", "is usually the ..."]
    compose_question(clues)                             # "What is the name of a red supergiant star ... that is ...?"
"""

from __future__ import annotations

import re

from utils.text import contains_answer

MAX_CLUE_WORDS = 16    # a longer clue is cut at its first clause break, or skipped: short questions for a 135M model
STOPWORDS = set("a an the of in on at by for and or to from with as is was are were that which who whom whose "
                "what when where why how its their his her this these those be been".split())


def strip_parens(title: str) -> str:
    return re.sub(r"\s*\(.*?\)\s*", " ", title).strip()


def desc_phrase(desc: str, extract: str = "") -> str:
    """The description as a noun phrase after "the ...": a leading article dropped, the first
    letter lower-cased unless the first word is a proper noun (capitalised mid-sentence in the
    article's extract, e.g. "American"; or an acronym). prepare_data lower-cases always and writes
    "the american writer"; this keeps "the American writer" but "the chemical element"."""
    desc = re.sub(r"^(a|an|the)\s+", "", desc.strip(), flags=re.IGNORECASE)
    first = desc.split()[0] if desc.split() else ""
    core = re.sub(r"\W", "", first)
    proper = bool(core) and (core.isupper() and len(core) > 1 or any(c.isupper() for c in core[1:]))
    if not proper and core[:1].isupper():
        toks = extract.split()
        proper = any(re.sub(r"\W", "", toks[i]) == core and not toks[i - 1].endswith((".", "!", "?"))
                     for i in range(1, len(toks)))
    return desc if proper else desc[:1].lower() + desc[1:]


def shorter_query(text: str, drop_head: bool = False) -> str:
    """A keyword version of a query: punctuation and stopwords gone. drop_head (for descriptions)
    also drops the leading head noun ("Family of fishes" -> "fishes"): it is the generic word
    ("Family", "Type", "River") that BM25 finds in hundreds of articles. On a 1000-candidate
    sample this rescued 30 of 255 first-query misses; the plain keyword version rescued none."""
    words = [w for w in re.sub(r"[()\[\],;:?!\"]", " ", text).split() if w.lower() not in STOPWORDS]
    return " ".join(words[1:] if drop_head and len(words) > 2 else words)


_ABBREV = re.compile(r"(?:\b[A-Z]|\b(?:St|Mr|Mrs|Ms|Dr|Jr|Sr|Prof|Gen|Col|Lt|Mt|Ft|No|vs|etc|ca|c|approx))\.$")
_COPULA = re.compile(r"^(?P<subj>\S.*?)\s(?:is|was|are|were)\s(?P<pred>\S.*)$")
# "It is believed that ...": the "It" of such a sentence is not the answer
_EXPLETIVE = re.compile(r"^(?:is|was|are|were|has been|had been|seems|appears)(?: \w+)? that\b")


def sentences(text: str) -> list[str]:
    """Sentences of an article's text, parentheticals dropped ("(born 1950)", "(ATP)"; not the
    "(OH)" of "Al2Si2O5(OH)4"). A period after an initial or a common abbreviation ("H. P.
    Lovecraft", "St. Louis") ends nothing."""
    out, start = [], 0
    for m in re.finditer(r"[.!?](?=\s+[A-Z\"'])", text):
        if not _ABBREV.search(text[start:m.end()]):
            out.append(text[start:m.end()])
            start = m.end()
    out.append(text[start:])
    cleaned = []
    for s in out:
        while (t := re.sub(r"(?:^|\s+)[(\[][^()\[\]]*[)\]]", "", s)) != s:
            s = t
        s = re.sub(r"\s+([,;:.!?])", r"\1", " ".join(s.split()))
        if s:
            cleaned.append(s)
    return cleaned


def _clue(pred: str, answers: list[str]) -> str | None:
    """A predicate as a clue: the final stop gone, cut at a semicolon ("a chemical element; it has
    symbol Er ..." reads badly once joined to a second clue) and, when longer than MAX_CLUE_WORDS,
    at the first clause break, then before a relative clause ("a French-born American industrial
    designer who achieved fame ..."); None if still too long, a single word, or it names the answer."""
    pred = pred.split(";")[0].strip().rstrip(".!?").strip()
    for brk in (r",\s|:\s|\s[–—-]\s", r"\s(?=(?:who|whose|which|that|where|when)\s)"):
        if len(pred.split()) > MAX_CLUE_WORDS:
            pred = re.split(brk, pred, maxsplit=1)[0].strip()
    ok = 2 <= len(pred.split()) <= MAX_CLUE_WORDS and not contains_answer(pred, answers)
    return pred if ok else None


def article_clues(text: str, name: str, answers: list[str]) -> list[str]:
    """Clues about the answer, in article order, read off its article's text (title line removed).

    The first is the predicate of the first sentence ("Betelgeuse is a red supergiant star in the
    equatorial constellation of Orion." -> "a red supergiant star in the equatorial constellation
    of Orion"); it is [] when that sentence has no short subject and copula. Later ones are the
    predicates of sentences whose subject is the answer: a pronoun, the name, "The <name>", or the
    name's last word, for a person's surname ("It has been contested at ..." -> "has been contested
    at ...", "Kelly sought to ..." -> "sought to ...")."""
    sents = sentences(text)
    m = _COPULA.match(sents[0]) if sents else None
    first = _clue(m.group("pred"), answers) if m and len(m.group("subj").split()) <= 12 else None
    if first is None:
        return []
    words = name.split()
    subjects = sorted({"It", "He", "She", "They", name, f"The {name}"} | ({words[-1]} if len(words) > 1 else set()),
                      key=len, reverse=True)
    out = [first]
    for s in sents[1:]:
        sub = next((x for x in subjects if s.startswith(x + " ")), None)
        pred = s[len(sub) + 1:] if sub is not None else ""
        if pred[:1].islower() and not _EXPLETIVE.match(pred) and (c := _clue(pred, answers)):
            out.append(c)
    return out


def compose_question(clues: list[str]) -> str:
    """"What is the name of <clue 1>?", later clues joined as "that <clue 2>, <clue 3> and <clue 4>"
    ("and <clue 2>, ..." when clue 1 has a relative clause already: "a procedure that removes ...")."""
    q = f"What is the name of {clues[0]}"
    if len(clues) > 1:
        rest = clues[1:]
        joint = " and " if re.search(r"\b(that|which|who|whose)\b", clues[0]) else " that "
        q += joint + (rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and " + rest[-1])
    return q + "?"


def clue_query(clue: str) -> str:
    """The clue as the question spells it, minus a leading article: a query copied from the question."""
    return re.sub(r"^(a|an|the)\s+", "", clue, flags=re.IGNORECASE)
