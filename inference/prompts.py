"""Prompts for both roles, the chat templates they are wrapped in, and the document block.

Tag protocol (shared with inference/parser.py and inference/rollout.py):
  <think>..</think>               free reasoning, never parsed
  <search>query</search>          a search call; generation stops at </search>
  <information>..</information>   written by the environment (or by the model itself in
                                  self-search mode); never trained on
  <answer>..</answer>             solver's final answer; generation stops there
  <question>..</question>         proposer's final question; generation stops there

Templates (`template=` flag):
  "auto"      the tokenizer's own chat template (apply_chat_template). The default.
  "r_search"  plain text, no chat special tokens. R-Search (QingFei1/R-Search,
              src/eval/main.py) uses the tokenizer's chat template when there is one and
              otherwise joins instruction and question with a newline; we keep that
              token-free form and add "User:"/"Assistant:" cues so a base model knows
              where its turn starts.
  "llama3.1"  Llama-3.1 chat format written out as a string
  "qwen3"     Qwen3 chat format (ChatML) written out as a string
The string templates work with any tokenizer: with the matching tokenizer their marker
strings map onto its special tokens, with another tokenizer they are plain text.

The instruction goes into the user message (not a system message) because some chat
templates refuse or rewrite system messages; the result is the same for all four.
"""

from __future__ import annotations

from typing import Any, Iterable

TEMPLATES = ("auto", "r_search", "llama3.1", "qwen3")

SOLVER_INSTRUCTION = (
    "Find the answer to the question below. Reason step by step inside <think> and </think>. "
    "When a fact is missing, look it up: write a short search query as <search> query </search> "
    "and the results will be shown to you between <information> and </information>. "
    "Search as often as you need, one query at a time. Once you are sure, give only the final "
    "short answer inside <answer> and </answer>, for example <answer> Marie Curie </answer>."
)

PROPOSER_INSTRUCTION = (
    "You set puzzles for a search game. Write one question whose correct answer is exactly: "
    "{answer}\n"
    "Work backwards from this answer. Search for a fact about it with <search> query </search>; "
    "results are shown to you between <information> and </information>. Then follow that fact to "
    "another entity and search again, so that a player needs about {n} searches to get from your "
    "question to the answer. Reason inside <think> and </think>. The question must be answerable "
    "from what you found, must have only this one answer, and must not contain the answer itself. "
    "When you are done, write the question alone inside <question> and </question>."
)


# --- chat formats written as strings ---------------------------------------------------------

def _llama31(user: str) -> str:
    # The official Llama-3.1 template always emits a system header with these two date lines,
    # even without a system message; matching it keeps the prompt in-distribution.
    return (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def _qwen3(user: str) -> str:
    # Qwen3 has no default system message; thinking mode is the default, and our protocol
    # writes its own <think> tags, so the generation prompt is the bare assistant header.
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _r_search(user: str) -> str:
    return f"User: {user}\nAssistant:"


def render_chat(tokenizer: Any, user: str, template: str = "auto") -> str:
    """The prompt text for one user message, ending where the assistant starts writing."""
    if template == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "template='auto' needs a tokenizer with a chat template, and this one has none; "
                f"pass one of {TEMPLATES[1:]} instead"
            )
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
    if template == "llama3.1":
        return _llama31(user)
    if template == "qwen3":
        return _qwen3(user)
    if template == "r_search":
        return _r_search(user)
    raise ValueError(f"unknown template {template!r}; choose one of {TEMPLATES}")


def encode_prompt(tokenizer: Any, text: str, template: str) -> list[int]:
    """Token ids of a rendered prompt.

    Chat-formatted strings already hold their BOS marker (or the template adds it),
    so no special tokens are added; the plain r_search text gets the tokenizer's own
    default (a BOS where the model expects one).
    """
    add_special = template == "r_search"
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def solver_user_message(question: str, privileged: str | None = None) -> str:
    """The solver's user message; `privileged` (a teacher block, below) goes between the instruction and
    the question, so the teacher's prompt differs from the student's by that block alone."""
    block = f"\n\n{privileged.strip()}" if privileged and privileged.strip() else ""
    return f"{SOLVER_INSTRUCTION}{block}\n\nQuestion: {str(question).strip()}"


# --- the teacher of self-distillation (issue 22) ----------------------------------------------
# The solver's teacher is the same model given the proposer's question construction path (QCP) as
# privileged context. Its prompt is the solver prompt with this block between the instruction and the
# question; the student's sampled response (its <information> blocks included) follows it unchanged:
#
#   <instruction>
#
#   Privileged notes (the question's author found this; the player cannot see it):
#   Answer: <answer>
#   Search 1: <query 1>
#   Doc 1 (Title: T) text ...
#   Search 2: <query 2>
#   ...
#
#   Question: <question>
TEACHER_HEADER = "Privileged notes (the question's author found this; the player cannot see it):"


def teacher_context(tokenizer: Any, answer: Any, queries: Iterable[str] | None = None,
                    docs: Iterable[Iterable[Any]] | None = None, max_tokens: int = 512) -> str:
    """The privileged block of a question: its answer, then each of the proposer's searches in order with
    the documents it returned (format_docs lines), cut to `max_tokens` tokens of `tokenizer`. The answer
    and the search lines are kept first; documents are cut from the end, a whole line at a time, then the
    last kept line by tokens. queries=None gives the answer alone (the plain "hint" form)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (the --distill_context_tokens budget), got {max_tokens}")
    golden = answer[0] if isinstance(answer, (list, tuple)) and answer else answer
    golden = str(golden or "").strip()
    if not golden:
        raise ValueError("teacher_context needs the question's answer; got an empty one")
    head = [TEACHER_HEADER, f"Answer: {golden}"]
    queries, docs = list(queries or []), [list(d) for d in (docs or [])]
    lines: list[tuple[str, bool]] = []            # (line, is a document line)
    for i, q in enumerate(queries):
        lines.append((f"Search {i + 1}: {str(q).strip()}", False))
        found = docs[i] if i < len(docs) else []
        lines += [(ln, True) for ln in format_docs(found).splitlines() if found]
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    searches = [ln for ln, is_doc in lines if not is_doc]
    # the answer and every search line come first (they are the path); documents share what is left
    budget = max_tokens - count("\n".join(head + searches))
    if budget < 0:
        return _cut_tokens(tokenizer, "\n".join(head + searches), max_tokens)
    out = list(head)
    for ln, is_doc in lines:
        if not is_doc:
            out.append(ln)
            continue
        need = count("\n" + ln)
        if need <= budget:
            out.append(ln)
            budget -= need
        elif budget > 8:                          # room for a useful head of this line: cut it there
            out.append(_cut_tokens(tokenizer, ln, budget - 1))
            budget = 0
    return _cut_tokens(tokenizer, "\n".join(out), max_tokens)   # token counts of joined lines may add up 1-2 more


def _cut_tokens(tokenizer: Any, text: str, n: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= n else tokenizer.decode(ids[:max(0, n)]).rstrip()


def build_teacher_prompt(tokenizer: Any, question: str, privileged: str, template: str = "auto") -> list[int]:
    """Token ids of the teacher's prompt: the solver prompt with the privileged block before the question."""
    return encode_prompt(tokenizer, render_chat(tokenizer, solver_user_message(question, privileged), template),
                         template)


def proposer_user_message(answer: Any, n_searches: int) -> str:
    if isinstance(answer, (list, tuple)):
        if not answer:
            raise ValueError("proposer answer list is empty; give at least one ground-truth answer")
        answer = answer[0]  # the first golden answer is the canonical one
    answer = str(answer).strip()
    if not answer:
        raise ValueError("proposer answer is empty; every proposer row needs a ground-truth answer")
    n = int(n_searches)
    if n < 1:
        raise ValueError(f"n_searches must be >= 1, got {n_searches!r}")
    return PROPOSER_INSTRUCTION.format(answer=answer, n=n)


def build_solver_prompt(tokenizer: Any, question: str, template: str = "auto") -> list[int]:
    """Token ids of the solver's first prompt for `question`."""
    return encode_prompt(tokenizer, render_chat(tokenizer, solver_user_message(question), template), template)


def build_proposer_prompt(tokenizer: Any, answer: Any, n_searches: int, template: str = "auto") -> list[int]:
    """Token ids of the proposer's prompt: write a question whose answer is `answer`, using ~n searches."""
    text = render_chat(tokenizer, proposer_user_message(answer, n_searches), template)
    return encode_prompt(tokenizer, text, template)


def doc_title(d: Any) -> str:
    """A document's title as the model reads it in format_docs: the first line of its contents, stripped;
    contents without a newline have no title."""
    contents = str(d.get("contents", "") if isinstance(d, dict) else d)
    title, sep, _ = contents.partition("\n")
    return title.strip() if sep else ""


def format_docs(docs: Iterable[Any] | None) -> str:
    """The text inside <information>: one line per document, 'Doc i (Title: T) text'.

    Docs are the search backend's dicts {"id", "contents": "Title\\ntext", "score"};
    a bare string is taken as contents. A doc whose contents has no newline is all text
    with an empty title. No docs gives "No results." so the model still sees a block.
    """
    lines = []
    for i, d in enumerate(docs or [], start=1):
        contents = d.get("contents", "") if isinstance(d, dict) else str(d)
        contents = str(contents)
        title, sep, text = contents.partition("\n")
        if not sep:
            title, text = "", contents
        text = " ".join(text.split())
        lines.append(f"Doc {i} (Title: {title.strip()}) {text}")
    return "\n".join(lines) + "\n" if lines else "No results.\n"


# A two-example few-shot head of the search protocol, for a model with no chat tuning: the rollout benches and
# the rollout tests prompt a base or instruct model with it, so it searches and answers in the protocol's tags.
SEARCH_FEW_SHOT = (
    "Question: What is the capital of Italy?\n<search> capital of Italy </search>\n\n<information>Doc 1 (Title: Rome) "
    "Rome is the capital city of Italy.\n</information>\n\n<answer> Rome </answer>\n\n"
    "Question: Who discovered penicillin?\n<search> penicillin discovery </search>\n\n<information>Doc 1 (Title: "
    "Penicillin) Penicillin was discovered by Alexander Fleming in 1928.\n</information>\n\n<answer> Alexander Fleming "
    "</answer>\n\n"
)
