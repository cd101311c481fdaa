"""Facts a title cannot answer, read off the corpus: one-hop reading facts and two-hop chains.

A *reading fact* is (entity, relation, answer, sentence, question): the answer is a span of the
entity's page text, not a page title by construction of the question ("In what year was the
Akashi Kaikyo Bridge completed?" -> 1998; "What is the capital of Abkhazia?" -> Sukhumi). The
sentence that holds it is what a cold-start demonstration quotes.

Only sentences a solver can see are used: the rollout cuts one <information> block (three docs,
"Doc i (Title: T) text") to --max_info_tokens tokens, so a fact counts only if its sentence ends
inside that budget when its page comes back as Doc 1 (`visible_text`). A fact past the cut is
unanswerable under the protocol, whatever the policy.

Relations (regular expressions over whole sentences; the rule is the docstring of each pattern):
  year            a sentence with exactly one year, written "in YYYY", whose subject is the entity
                  (its name, "The <name>", a surname, or It/He/She/They): the question is the
                  sentence with "in YYYY" as "in what year" and the pronoun as the name
  capital, largest_city, official_language, located_in, capital_of, founded_by, directed_by,
  written_by, named_after, discovered_by, born_in
                  fixed phrasings ("Its capital is Y", "X is a city in Y", "directed by Y"), each
                  with a question template; the answer is the captured name
A *chain* joins a bridge fact (X, r1, Y), where Y is itself a page, to a fact (Y, r2, Z) of Y's page:
"What is the capital of the place where Abuja is located?" needs X's page to name Y and a second
search for Y's page to read Z. The question names X and the relation, never Y.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable

from dataprep.clues import sentences, strip_parens
from utils.text import normalize_answer

INFO_TAG_TOKENS = 12  # "\n\n<information>" + "</information>\n\n" in SmolLM2's tokenizer: 11; one spare
MAX_QUESTION_WORDS = 30

_NAME = r"([A-Z][\w'’.-]*(?: (?:de |of |van |von |da |al-)?[A-Z][\w'’.-]*){0,3})"
_NAME2 = r"([A-Z][\w'’.-]*(?: (?:de |of |van |von |da |al-)?[A-Z][\w'’.-]*){1,3})"  # people: two words or more
# relation -> (patterns over a sentence, question template over the entity); group 1 is the answer
_R = re.compile
RELATIONS: dict[str, tuple[list[re.Pattern], str]] = {
    "capital": ([_R(r"\b(?:[Ii]ts|[Tt]he) capital(?: and (?:largest|most populous) city)?,? (?:is )?" + _NAME),
                 _R(r"\bwith " + _NAME + r" as (?:its|the) capital"),
                 _R(r"^" + _NAME + r"(?:,[^,]{1,80},)? is the (?:country's |state's |province's |region's )?capital\b")],
                "What is the capital of {}?"),
    "largest_city": ([_R(r"\b(?:[Ii]ts|[Tt]he) (?:largest|most populous) city(?: and capital)? is " + _NAME),
                      _R(r"\b[Tt]he largest city in (?:the country|\w+(?: \w+)?)(?: by population)? is " + _NAME),
                      _R(r"^" + _NAME + r"(?:,[^,]{1,80},)? is the (?:country's )?capital and largest city\b")],
                     "What is the largest city of {}?"),
    "official_language": ([_R(r"\b(?:[Ii]ts|[Tt]he) (?:sole |only )?official languages? (?:is|are) " + _NAME)],
                          "What is the official language of {}?"),
    "population": ([_R(r"\bpopulation of (?:about |around |over |more than |almost |nearly |approximately )?"
                       r"(\d(?:[\d.,]*\d)?(?: (?:million|billion))?)")],
                   "What is the population of {}?"),
    "located_in": ([_R(r"^(?:\S+ ){1,6}?(?:is|was) (?:a|an|the) (?:[\w-]+ ){0,3}?(?:city|town|capital|port|"
                       r"country|river|island|mountain|lake|state|region|province|village|municipality) "
                       r"(?:in|of|on) (?:the )?" + _NAME)],
                   "Where is {} located?"),
    "capital_of": ([_R(r"\bis the capital(?: and (?:largest|most populous) city)? of (?:the )?" + _NAME)],
                   "Of which place is {} the capital?"),
    "founded_by": ([_R(r"\b(?:was|were) (?:co-)?founded (?:in \d{4} )?by " + _NAME2)], "Who founded {}?"),
    "directed_by": ([_R(r"\bdirected by " + _NAME2)], "Who directed {}?"),
    "written_by": ([_R(r"\b(?:was|is) (?:\w+ )?written by " + _NAME2)], "Who wrote {}?"),
    "named_after": ([_R(r"\b(?:is|was|are|were) named (?:after|for) " + _NAME2)], "Who is {} named after?"),
    "discovered_by": ([_R(r"\b(?:was|were) (?:first )?discovered (?:in \d{4} )?by " + _NAME2)], "Who discovered {}?"),
    "born_in": ([_R(r"\b(?:was|were) born in " + _NAME)], "Where was {} born?"),
}
# a bridge fact (X, r, Y) as a noun phrase for Y, naming X
BRIDGE_NP = {
    "capital": "the capital of {}", "largest_city": "the largest city of {}", "located_in": "the place where {} is",
    "capital_of": "the place whose capital is {}", "founded_by": "the founder of {}", "directed_by": "the director of {}",
    "written_by": "the author of {}", "named_after": "the namesake of {}", "discovered_by": "the discoverer of {}",
    "born_in": "the birthplace of {}",
}
# a captured name made only of these words is a cut-off phrase ("Central" of "Central and Eastern Europe")
# second-hop templates where RELATIONS' own reads badly around a noun phrase
CHAIN_QUESTION = {"located_in": "In what region is {}?"}
SECOND_HOP_SKIP = {"capital_of"}  # "What is the largest city of X the capital of?" reads as nonsense
_GENERIC = set("north south east west northern southern eastern western central upper lower greater new old "
               "great first second".split())
_YEAR = re.compile(r"\b(?:1\d{3}|20\d\d)\b")
_TRAIL = re.compile(r"[.,;:]+$")


@dataclasses.dataclass(frozen=True)
class Fact:
    entity: str       # the page title the fact is read from
    relation: str
    answer: str
    sentence: str     # the sentence that holds the answer, as sentences() cleans it
    question: str     # asked about the entity by name
    doc_id: str = ""
    subject_np: str = ""  # year facts: the question after the entity's name, for chains (" was completed in what year")


@dataclasses.dataclass(frozen=True)
class Chain:
    bridge: Fact      # (X, r1, Y)
    fact: Fact        # (Y, r2, Z)
    question: str

    @property
    def answer(self) -> str:
        return self.fact.answer


def read_corpus(path: Path) -> list[dict]:
    """[{"id", "title", "text"}] of a corpus JSONL whose contents are "Title\\ntext"."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                title, _, text = str(d["contents"]).partition("\n")
                out.append({"id": str(d["id"]), "title": title.strip(), "text": text.strip()})
    return out


def visible_text(tok: Any, title: str, text: str, max_info_tokens: int) -> str:
    """The part of a page's text a solver sees when the page is Doc 1 of a search under the rollout's
    --max_info_tokens cut; only its whole sentences count (the last, cut one is dropped unless it is whole)."""
    head = f"Doc 1 (Title: {title}) "
    room = max(0, max_info_tokens - INFO_TAG_TOKENS)
    enc = tok(head + text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) <= room:
        return text
    cut = enc["offset_mapping"][room - 1][1] - len(head)
    sents = sentences(text[:max(0, cut)])
    whole = sentences(text)
    return " ".join(s for s, w in zip(sents, whole) if s == w)


def _subjects(name: str) -> list[str]:
    words = name.split()
    return sorted({"It", "He", "She", "They", name, f"The {name}"} | ({words[-1]} if len(words) > 1 else set()),
                  key=len, reverse=True)


def _clean_answer(a: str) -> str:
    return _TRAIL.sub("", a.strip()).strip()


def year_facts(title: str, name: str, sents: list[str], doc_id: str) -> list[Fact]:
    """Year facts: see the module docstring. A sentence whose subject is not the entity is asked as
    "<name>: <the sentence, "in what year">?"; its page is still the one to read."""
    out = []
    for s in sents:
        years = _YEAR.findall(s)
        if len(years) != 1 or len(s.split()) > MAX_QUESTION_WORDS or not re.search(rf"\bin {years[0]}\b", s):
            continue
        cloze = re.sub(rf"\bin {years[0]}\b", "in what year", s).rstrip(".!? ")
        sub = next((x for x in _subjects(name) if s.startswith(x + " ")), None)
        if sub is not None and cloze[len(sub) + 1:][:1].islower():
            tail = " " + cloze[len(sub) + 1:]
        elif re.match(r"(?:It|He|She|They|Its|His|Her|Their)\b", s):
            continue  # a pronoun that is not the subject's: no way to say whom it means
        else:
            tail = ": " + cloze
        out.append(Fact(title, "year", years[0], s, f"{name}{tail}?", doc_id, tail))
    return out


def relation_facts(title: str, name: str, sents: list[str], doc_id: str) -> list[Fact]:
    """Facts of the fixed phrasings: see RELATIONS. The answer must not be the entity, nor a word of it."""
    out, seen = [], set()
    for i, s in enumerate(sents):
        for rel, (pats, template) in RELATIONS.items():
            if rel in seen:
                continue
            m = next((m for pat in pats if (m := pat.search(s))), None)
            # located_in reads "<subject> is a city in Y": the subject must be the entity
            if not m or (rel == "located_in" and i > 0 and not any(s.startswith(x + " ") for x in _subjects(name))):
                continue
            ans = _clean_answer(m.group(1))
            na, ne = normalize_answer(ans), normalize_answer(name)
            if (not na or na == ne or na in ne.split() or ne in na or len(ans) < 3
                    or set(na.split()) <= _GENERIC):
                continue
            seen.add(rel)
            out.append(Fact(title, rel, ans, s, template.format(name), doc_id))
    return out


def page_facts(page: dict, visible: str) -> list[Fact]:
    """Every fact of one page whose sentence lies in the visible text."""
    name = strip_parens(page["title"])
    if not name or not visible:
        return []
    sents = sentences(visible)
    return relation_facts(page["title"], name, sents, page["id"]) + year_facts(page["title"], name, sents, page["id"])


def second_hop_question(np: str, f: Fact) -> str | None:
    """Fact f of the bridge entity Y asked about through the noun phrase np that names X."""
    if f.relation in SECOND_HOP_SKIP:
        return None
    if f.relation == "year":
        return f"{np[:1].upper()}{np[1:]}{f.subject_np}?" if f.subject_np else None
    if f.relation in CHAIN_QUESTION:
        return CHAIN_QUESTION[f.relation].format(np)
    if f.relation in RELATIONS:
        return RELATIONS[f.relation][1].format(np)
    return None


def chains(facts: Iterable[Fact], titles: dict[str, str]) -> list[Chain]:
    """Two-hop chains: a bridge fact whose answer is a page title (exact, or without its parenthetical),
    joined to each fact of that page whose answer is neither X nor Y. `titles`: normalised name -> title."""
    facts = list(facts)
    by_entity: dict[str, list[Fact]] = {}
    for f in facts:
        by_entity.setdefault(f.entity, []).append(f)
    out = []
    for b in facts:
        if b.relation not in BRIDGE_NP:
            continue
        y = titles.get(normalize_answer(b.answer))
        if y is None or y == b.entity:
            continue
        np = BRIDGE_NP[b.relation].format(strip_parens(b.entity))
        for f in by_entity.get(y, []):
            if normalize_answer(f.answer) in (normalize_answer(strip_parens(b.entity)), normalize_answer(b.answer)):
                continue
            q = second_hop_question(np, f)
            # the question must not name the bridge: finding it is the first hop
            if q and len(q.split()) <= MAX_QUESTION_WORDS and f" {normalize_answer(strip_parens(y))} " not in f" {normalize_answer(q)} ":
                out.append(Chain(b, f, q))
    return out


def corpus_facts(pages: list[dict], tok: Any, max_info_tokens: int) -> tuple[list[Fact], dict[str, str]]:
    """All visible facts of the corpus, and the normalised-name -> title map chains look bridges up in."""
    facts: list[Fact] = []
    titles: dict[str, str] = {}
    for p in pages:
        for key in {normalize_answer(p["title"]), normalize_answer(strip_parens(p["title"]))}:
            titles.setdefault(key, p["title"])
        facts += page_facts(p, visible_text(tok, p["title"], p["text"], max_info_tokens))
    return facts, titles
