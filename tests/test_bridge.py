"""The engine bridge: one engine thread serving many submitting threads, aborts, rejections, windows."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from worker.bridge import EngineBridge
from worker.engine import LLM, RequestRejected, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 17 + j) % 400 for j in range(4 + i % 9)] for i in range(n)]


def test_many_threads_get_the_engines_own_outputs(llm):
    expected = [o.token_ids for o in llm.generate(prompts(24), PARAMS)]
    windows = []
    bridge = EngineBridge(lambda: llm, window_seconds=0.01, on_window=windows.append).start()
    got: dict[int, list[int]] = {}

    def worker(ids: range) -> None:
        futures = {i: bridge.submit(f"t{i}", prompts(24)[i], PARAMS) for i in ids}
        for i, f in futures.items():
            got[i] = f.result(timeout=60).token_ids

    threads = [threading.Thread(target=worker, args=(range(k, 24, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bridge.stop(timeout=10)
    assert [got[i] for i in range(24)] == expected
    assert sum(w.steps for w in windows) > 0
    assert sum(w.decode_tokens for w in windows) == 24 * 7
    assert all(0 < w.occupancy <= 1 for w in windows if w.steps)
    assert all(w.max_running <= 8 for w in windows)
    assert llm.stats()["kv_blocks_used"] == 0


def test_rejected_requests_fail_their_future_only(llm):
    bridge = EngineBridge(lambda: llm).start()
    bad = bridge.submit("too-long", list(range(5, 300)), PARAMS)
    good = bridge.submit("fine", [5, 6, 7], PARAMS)
    with pytest.raises(RequestRejected, match="max_model_len"):
        bad.result(timeout=30)
    assert len(good.result(timeout=30).token_ids) == 8
    bridge.stop(timeout=10)


def test_abort_cancels_and_stop_cancels_the_rest(llm):
    bridge = EngineBridge(lambda: llm).start()
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    a = bridge.submit("a", [5, 6, 7], long)
    b = bridge.submit("b", [8, 9], long)
    bridge.abort("a")
    with pytest.raises(CancelledError):
        a.result(timeout=30)
    bridge.stop(timeout=10)
    with pytest.raises(CancelledError):
        b.result(timeout=1)
    assert not llm.has_unfinished_requests()
    assert llm.stats()["kv_blocks_used"] == 0
    after = bridge.submit("late", [5], PARAMS)
    with pytest.raises(RuntimeError, match="not running"):
        after.result(timeout=1)
