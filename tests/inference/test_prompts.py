"""Prompt building for every template, with SmolLM2's real tokenizer."""

from __future__ import annotations

import copy

import pytest

from inference.prompts import (
    PROPOSER_INSTRUCTION, SOLVER_INSTRUCTION, TEMPLATES, build_proposer_prompt, build_solver_prompt, format_docs,
    render_chat, solver_user_message,
)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


# What each template must put around the user message, and where the assistant turn starts.
EXPECT = {
    "auto": ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM", "<|im_start|>user\n",
             "<|im_end|>\n<|im_start|>assistant\n"),
    "r_search": ("User: ", "User: ", "\nAssistant:"),
    "llama3.1": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date",
                 "<|start_header_id|>user<|end_header_id|>\n\n",
                 "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen3": ("<|im_start|>user\n", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("template", TEMPLATES)
def test_solver_prompt_per_template(tok, template):
    q = "Which river flows through Vienna?"
    ids = build_solver_prompt(tok, q, template=template)
    text = tok.decode(ids)
    start, user_open, tail = EXPECT[template]
    assert text.startswith(start)
    assert f"{user_open}{SOLVER_INSTRUCTION}\n\nQuestion: {q}" in text
    assert text.endswith(tail)
    # ids are exactly the tokenised rendering: nothing added, nothing lost
    rendered = render_chat(tok, solver_user_message(q), template)
    assert text == rendered
    assert ids == tok(rendered, add_special_tokens=(template == "r_search"))["input_ids"]
    if template == "r_search":
        assert "<|im_start|>" not in text and "<|" not in text


@pytest.mark.parametrize("template", TEMPLATES)
def test_proposer_prompt_per_template(tok, template):
    ids = build_proposer_prompt(tok, ["Danube", "Donau"], 3, template=template)
    text = tok.decode(ids)
    body = PROPOSER_INSTRUCTION.format(answer="Danube", n=3)
    assert body in text and "Donau" not in text  # the first golden answer is the canonical one
    assert "about 3 searches" in text and "<question>" in text and "<search>" in text
    assert text.endswith(EXPECT[template][2])


def test_auto_matches_the_tokenizers_own_template(tok):
    msg = SOLVER_INSTRUCTION + "\n\nQuestion: What is 2+2?"
    want = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False)
    ids = build_solver_prompt(tok, "What is 2+2?")
    assert tok.decode(ids) == want
    assert ids == tok(want, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # ChatML marker became the special token


def test_bad_inputs_name_the_problem(tok):
    with pytest.raises(ValueError, match="unknown template 'chatml2'"):
        build_solver_prompt(tok, "q", template="chatml2")
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        build_solver_prompt(bare, "q")
    assert build_solver_prompt(bare, "q", template="r_search")  # plain text works without one
    with pytest.raises(ValueError, match="empty"):
        build_proposer_prompt(tok, "  ", 2)
    with pytest.raises(ValueError, match="empty"):
        build_proposer_prompt(tok, [], 2)
    with pytest.raises(ValueError, match="n_searches"):
        build_proposer_prompt(tok, "Paris", 0)


def test_format_docs():
    docs = [
        {"id": "1", "contents": "Paris\nParis is the capital\nof France.", "score": 3.2},
        {"id": "2", "contents": "no title line", "score": 1.0},
        "Vienna\nCapital of Austria.",
    ]
    assert format_docs(docs) == (
        "Doc 1 (Title: Paris) Paris is the capital of France.\n"
        "Doc 2 (Title: ) no title line\n"
        "Doc 3 (Title: Vienna) Capital of Austria.\n"
    )
    assert format_docs([]) == "No results.\n"
    assert format_docs(None) == "No results.\n"


# --- the self-distillation teacher's prompt (issue 22) ---------------------------------------

QCP_DOCS = [[{"id": "1", "contents": "1900 Summer Olympics\nThe games were held in Paris, France.", "score": 2.0},
             {"id": "2", "contents": "Paris\nParis is the capital of France. The Seine flows through it.", "score": 1.0}],
            [{"id": "3", "contents": "Seine\nThe Seine is a river in northern France.", "score": 1.5}]]


def test_student_prompt_is_unchanged_without_a_block():
    q = "Which river flows through the host city of the 1900 Olympics?"
    assert solver_user_message(q) == f"{SOLVER_INSTRUCTION}\n\nQuestion: {q}"
    assert solver_user_message(q, None) == solver_user_message(q, "  ") == solver_user_message(q)


@pytest.mark.parametrize("template", TEMPLATES)
def test_teacher_prompt_is_the_student_prompt_plus_the_block(tok, template):
    from inference.prompts import build_teacher_prompt, teacher_context

    q = "Which river flows through the host city of the 1900 Olympics?"
    block = teacher_context(tok, ["Seine", "River Seine"], ["1900 Olympics host", "Paris river"], QCP_DOCS, 512)
    student = tok.decode(build_solver_prompt(tok, q, template))
    teacher = tok.decode(build_teacher_prompt(tok, q, block, template))
    assert teacher.replace(f"\n\n{block}", "", 1) == student       # the block is the only difference
    assert teacher.index(SOLVER_INSTRUCTION) < teacher.index(block) < teacher.index(f"Question: {q}")


def test_teacher_context_keeps_the_path_in_order_and_fits_the_budget(tok):
    from inference.prompts import TEACHER_HEADER, teacher_context

    full = teacher_context(tok, ["Seine", "River Seine"], ["1900 Olympics host", "Paris river"], QCP_DOCS, 512)
    assert full.splitlines() == [
        TEACHER_HEADER, "Answer: Seine", "Search 1: 1900 Olympics host",
        "Doc 1 (Title: 1900 Summer Olympics) The games were held in Paris, France.",
        "Doc 2 (Title: Paris) Paris is the capital of France. The Seine flows through it.",
        "Search 2: Paris river", "Doc 1 (Title: Seine) The Seine is a river in northern France."]
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    for budget in (60, 45, 30, 12):
        cut = teacher_context(tok, "Seine", ["1900 Olympics host", "Paris river"], QCP_DOCS, budget)
        assert n(cut) <= budget
        assert full.startswith(cut.rsplit("\n", 1)[0])                  # a prefix of the whole, whole lines
        if budget >= 45:  # the answer and both searches survive a cut of the documents
            assert "Answer: Seine" in cut and "Search 1:" in cut and "Search 2: Paris river" in cut
    assert teacher_context(tok, "Seine", None, None, 64) == f"{TEACHER_HEADER}\nAnswer: Seine"   # the hint form
    with pytest.raises(ValueError, match="max_tokens"):
        teacher_context(tok, "Seine", [], [], 0)
    with pytest.raises(ValueError, match="empty"):
        teacher_context(tok, [""], [], [], 64)
