"""Accounting in the engine and its process: GPU-seconds shares, queue time, and the live metrics' figures."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest

from sluice.worker.engine import LLM, LLMEngine, SamplingParams
from sluice.worker.engine_process import EngineCore
from sluice.worker.engine_protocol import Abort, Report, Stop, Submit
from sluice.worker.metrics import EngineMetrics

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def test_gpu_seconds_shares_add_up_to_the_steps_wall_time(llama_dir):
    """Chunked prefill, prefix-cache hits, preemptions, an abort and requests finishing mid-step: every step's time
    is shared out once, among the sequences it ran, and nothing else is counted."""
    llm = LLM(str(llama_dir), max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=12, block_size=4)
    prompt = list(range(5, 45))
    seqs = []
    for i in range(6):
        llm.add_request(prompt[:20 + i], SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True), f"r{i}")
        seqs.append(llm.requests[f"r{i}"])
    steps = []
    while llm.has_unfinished_requests():
        llm.step()
        steps.append(llm.last_step.seconds)
        if len(steps) == 3:
            llm.abort("r5")
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0  # the cases the shares must survive
    assert sum(s.gpu_seconds for s in seqs) == pytest.approx(sum(steps), rel=1e-9)
    assert llm.busy_seconds == pytest.approx(sum(steps), rel=1e-9)


def test_queue_time_ends_when_a_request_is_first_scheduled(llama_dir, monkeypatch):
    """Not once its first step has run: that step is time to first token, not time queued."""
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    run = llm.runner.run

    def slow_run(scheduled):
        time.sleep(0.05)
        return run(scheduled)

    monkeypatch.setattr(llm.runner, "run", slow_run)
    m = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].metrics
    assert m.arrival_time <= m.first_scheduled_time
    assert m.first_token_time - m.first_scheduled_time >= 0.05


@pytest.fixture
def core(llama_dir):
    """An EngineCore looping on a thread: (send, reports()); reports() drains what it reported so far."""
    engine = LLMEngine(str(llama_dir), max_num_seqs=4, num_kv_blocks=64)
    requests_out, requests_in = Pipe(duplex=False)
    reports_out, reports_in = Pipe(duplex=False)
    loop = threading.Thread(target=EngineCore(engine, requests_out, reports_in, 60.0).loop, daemon=True)
    loop.start()

    def reports(timeout: float = 0.2) -> list[Report]:
        got = []
        while reports_out.poll(0 if got else timeout):
            got.append(reports_out.recv())
        return got

    yield requests_in.send, reports
    requests_in.send(Stop())
    loop.join(timeout=30)


def test_live_latencies_are_never_negative(core):
    """A request's arrival is its creation on the API host: a clock ahead of the worker's must not give negative
    TTFT and latency observations."""
    send, reports = core
    send([Submit("ahead", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), 0,
                 time.time() + 30)])
    deadline, latencies = time.time() + 30, []
    while not latencies and time.time() < deadline:
        latencies = [pair for r in reports() if r.live for pair in r.live.latencies]
    assert latencies and all(t >= 0 for pair in latencies for t in pair)


def test_aborts_in_an_idle_engine_update_the_live_gauges(core):
    """Aborting every request leaves no step to report the engine's state: the aborts report it, with no step
    time for the histogram."""
    send, reports = core
    send([Submit(f"r{i}", list(range(5, 25)), LONG, 0, time.time()) for i in range(3)])
    deadline, last, cancelled = time.time() + 30, None, 0

    def read() -> int:
        nonlocal last
        got = reports()
        last = next((r.live for r in reversed(got) if r.live), last)
        return sum(len(r.cancelled) for r in got)

    while (last is None or last.num_running < 3) and time.time() < deadline:
        read()
    for i in range(3):
        send(Abort(f"r{i}"))
    while cancelled < 3 and time.time() < deadline:
        cancelled += read()
    assert last is not None and (last.num_running, last.num_waiting, last.kv_blocks_used) == (0, 0, 0)
    metrics = EngineMetrics("m")
    metrics.observe(last)
    assert metrics.registry.get_sample_value("sluice:engine_num_requests_running", {"model_name": "m"}) == 0
    assert not metrics.registry.get_sample_value("sluice:engine_step_seconds_count", {"model_name": "m"})
