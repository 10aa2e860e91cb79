"""`sluice run` submits lines sharing a prompt prefix together (as the API chunks a batch): questions about one
document, shuffled in the file, reach the engine side by side; SLUICE_PREFIX_ORDER=0 keeps file order."""

from __future__ import annotations

import json
import random

import pytest

from sluice.api.batch_lines import CHAT_URL
from sluice.worker.adapters import ServedModels
from sluice.worker.engine import LLM
from sluice.worker.run import run_batch

DOCS = [" ".join(f"d{d}w{w}" for w in range(90)) for d in range(4)]


def lines() -> list[dict]:
    pairs = [(d, q) for d in range(4) for q in range(3)]
    random.Random(1).shuffle(pairs)
    return [{"custom_id": f"d{d}q{q}", "method": "POST", "url": CHAT_URL,
             "body": {"model": "m", "max_tokens": 2, "temperature": 0,
                      "messages": [{"role": "user", "content": DOCS[d]}, {"role": "user", "content": f"q{q}?"}]}}
            for d, q in pairs]


@pytest.mark.parametrize("ordered", [True, False])
def test_submissions_are_grouped_by_document(llama_dir, tmp_path, monkeypatch, ordered):
    monkeypatch.setenv("SLUICE_PREFIX_ORDER", "1" if ordered else "0")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines()) + "not json\n")
    llm = LLM(str(llama_dir))
    submitted = []
    add = llm.add_request
    monkeypatch.setattr(llm, "add_request", lambda *a, **k: (submitted.append(k["request_id"]), add(*a, **k))[1])
    summary = run_batch(source, tmp_path / "out.jsonl", tmp_path / "err.jsonl", llm, ServedModels("m"), set())
    assert (summary.succeeded, summary.failed) == (12, 1)
    docs = [custom_id[:2] for custom_id in submitted]
    if ordered:
        assert all(len(set(docs[i:i + 3])) == 1 for i in range(0, 12, 3)), docs
    else:
        assert submitted == [x["custom_id"] for x in lines()]
