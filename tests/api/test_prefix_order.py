"""Prefix-aware ordering: lines sharing a long prompt prefix end up side by side and in one chunk."""

from __future__ import annotations

import random

from sluice.api.batch_lines import ChatBody, CompletionBody
from sluice.api.prefix_order import PIECE_CHARS, pack, prefix_groups, prefix_key, prompt_text

DOCS = [" ".join(f"doc{d}-word{w}" for w in range(120)) for d in range(20)]  # about 1400 characters each


def chat(doc: int, question: int) -> ChatBody:
    return ChatBody.model_validate({"messages": [{"role": "system", "content": "Answer from the document."},
                                                 {"role": "user", "content": DOCS[doc]},
                                                 {"role": "user", "content": f"Question {question}?"}]})


def test_shuffled_questions_regroup_by_document_and_travel_in_one_chunk():
    lines = [(d, q) for d in range(20) for q in range(10)]
    random.Random(0).shuffle(lines)
    keys = [prefix_key(prompt_text(chat(d, q))) for d, q in lines]
    groups = prefix_groups(keys)
    assert sorted(len(g) for g in groups) == [10] * 20
    for g in groups:  # each group is one document's ten questions
        assert len({lines[i][0] for i in g}) == 1
    chunks = pack(groups, 32)
    assert all(len(c) <= 32 for c in chunks) and sorted(i for c in chunks for i in c) == list(range(200))
    for g in groups:  # no document split across chunks
        assert sum(1 for c in chunks if set(g) & set(c)) == 1


def test_groups_larger_than_a_chunk_and_short_prompts():
    keys = [prefix_key("x" * 3 * PIECE_CHARS + str(i)) for i in range(10)] + [prefix_key(f"q{i}") for i in range(5)]
    groups = prefix_groups(keys)
    assert [len(g) for g in groups if len(g) > 1] == [10]  # short prompts share nothing: each its own group
    chunks = pack(groups, 4)
    assert [len(c) for c in chunks[:3]] == [4, 4, 2] and all(len(c) <= 4 for c in chunks)
    assert prefix_key("") == () and prefix_groups([(), ()]) == [[0], [1]]


def test_keys_follow_text_prefixes_and_completion_prompts():
    a, b = "A" * 600 + "tail one", "A" * 600 + "tail two"
    ka, kb = prefix_key(a), prefix_key(b)
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert prompt_text(CompletionBody.model_validate({"prompt": [1, 2, 3]})) == "1 2 3"
    assert prompt_text(CompletionBody.model_validate({"prompt": "hi"})) == "hi"
