"""The engine bridge: the engine in its own process serving many submitting threads; aborts, rejections, windows,
build failures, and an engine process that dies with its worker or under it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError
from functools import partial

import pytest
from processes import thread_nices

from sluice.worker.bridge import EngineBridge, EngineNotRunning, default_engine_threads
from sluice.worker.cpus import PINNED_ENGINE_NICE, split_cpus
from sluice.worker.engine import LLM, LLMEngine, RequestRejected, SamplingParams
from sluice.worker.engine.config import ModelError

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="module")
def build(llama_dir):
    return partial(LLMEngine, str(llama_dir), **ENGINE)


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 17 + j) % 400 for j in range(4 + i % 9)] for i in range(n)]


def test_many_threads_get_the_engines_own_outputs(llama_dir, build):
    expected = [o.token_ids for o in LLM(str(llama_dir), **ENGINE).generate(prompts(24), PARAMS)]
    windows, steps = [], []
    bridge = EngineBridge(build, window_seconds=0.01, on_window=windows.append, on_step=steps.append).start()
    assert bridge.processor.max_request_tokens == 256
    assert bridge.process.pid != os.getpid()
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
    bridge.stop(timeout=30)
    assert [got[i] for i in range(24)] == expected
    assert sum(w.steps for w in windows) == len(steps) > 0
    assert sum(w.decode_tokens for w in windows) == 24 * 7
    assert sum(s.step.num_generated for s in steps) == 24 * 8
    assert sorted(len(s.latencies) for s in steps)[-1] >= 1 and sum(len(s.latencies) for s in steps) == 24
    assert all(0 < w.occupancy <= 1 for w in windows if w.steps)
    assert all(w.max_running <= 8 for w in windows)
    assert bridge.final_stats["kv_blocks_used"] == 0
    assert not bridge.process.is_alive() and bridge.error is None


def test_rejected_requests_fail_their_future_only(build):
    bridge = EngineBridge(build).start()
    bad = bridge.submit("too-long", list(range(5, 300)), PARAMS)
    good = bridge.submit("fine", [5, 6, 7], PARAMS)
    twice = bridge.submit("fine", [5, 6, 7], PARAMS)
    with pytest.raises(RequestRejected, match="max_model_len"):
        bad.result(timeout=30)
    with pytest.raises(RequestRejected, match="already in the engine"):
        twice.result(timeout=30)
    assert len(good.result(timeout=30).token_ids) == 8
    bridge.stop(timeout=30)


def test_abort_cancels_and_stop_cancels_the_rest(build):
    bridge = EngineBridge(build).start()
    a = bridge.submit("a", [5, 6, 7], LONG)
    b = bridge.submit("b", [8, 9], LONG)
    bridge.abort("a")
    with pytest.raises(CancelledError):
        a.result(timeout=30)
    bridge.stop(timeout=30)
    with pytest.raises(CancelledError):
        b.result(timeout=1)
    stats = bridge.final_stats
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    after = bridge.submit("late", [5], PARAMS)
    with pytest.raises(EngineNotRunning, match="not running"):  # never ran: a worker gives it back
        after.result(timeout=1)


def test_a_failed_build_raises_its_error(tmp_path):
    with pytest.raises(ModelError, match="config.json: not found"):
        EngineBridge(partial(LLMEngine, str(tmp_path))).start()


def test_an_engine_process_that_dies_fails_the_waiters(build):
    bridge = EngineBridge(build).start()
    waiting = bridge.submit("w", [5, 6, 7], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    os.kill(bridge.process.pid, signal.SIGKILL)
    with pytest.raises(CancelledError):
        waiting.result(timeout=30)
    assert "died" in str(bridge.error)
    with pytest.raises(EngineNotRunning, match="not running"):
        bridge.submit("x", [5], PARAMS).result(timeout=1)
    bridge.stop(timeout=10)


def test_the_engine_process_exits_when_its_worker_is_killed(llama_dir, tmp_path):
    """kill -9 of a worker must not leave its engine running (and holding the GPU)."""
    script = textwrap.dedent(f"""
        import sys, time
        from functools import partial
        from sluice.worker.bridge import EngineBridge, default_engine_threads
        from sluice.worker.engine import LLMEngine, SamplingParams
        if __name__ == "__main__":
            bridge = EngineBridge(partial(LLMEngine, {str(llama_dir)!r}, num_kv_blocks=64)).start()
            bridge.submit("busy", [5, 6], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
            print(bridge.process.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.time() + 30
        while time.time() < deadline and _alive(engine_pid):
            time.sleep(0.1)
        assert not _alive(engine_pid)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited; only its parent's init has not reaped it
    except FileNotFoundError:
        return False


def test_the_engine_leaves_the_worker_a_cpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert default_engine_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_engine_threads() == 1


def test_cpus_split_between_engine_and_worker(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert split_cpus(3) == ({4}, {5, 6, 7})
    assert split_cpus(4) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert split_cpus(1) is None


def pinned_run(llama_dir, tmp_path, prefix: list[str] = ()) -> tuple[dict, str]:
    """A worker-like child process with a pinned CPU engine: its engine's and its own threads' CPUs and nice
    values, the engine's tokens, and its stderr. In a child process: pinning pins the process that asks."""
    script = textwrap.dedent(f"""
        import json, logging, os, threading
        from functools import partial
        from sluice.worker.bridge import EngineBridge
        from sluice.worker.engine import LLMEngine, SamplingParams
        from processes import thread_cpus, thread_nices
        from test_bridge import prompts, ENGINE, PARAMS
        if __name__ == "__main__":
            logging.basicConfig(level="INFO")
            bridge = EngineBridge(partial(LLMEngine, {str(llama_dir)!r}, **ENGINE), threads=1, pin_cpus=True).start()
            release = threading.Event()
            later = threading.Thread(target=release.wait)  # a thread started after pinning inherits the CPUs
            later.start()
            futures = [bridge.submit(f"p{{i}}", p, PARAMS) for i, p in enumerate(prompts(12))]
            tokens = [f.result(timeout=60).token_ids for f in futures]
            pid = bridge.process.pid
            engine, worker = [sorted(c) for c in thread_cpus(pid)], [sorted(c) for c in thread_cpus(os.getpid())]
            nices = dict(engine_nices=sorted(thread_nices(pid)), worker_nices=sorted(thread_nices(os.getpid())))
            print(json.dumps(dict(pinned=bridge.pinned, engine=engine, worker=worker, tokens=tokens,
                                  reported_nice=bridge.engine_nice, **nices)), flush=True)
            release.set()
            later.join()
            bridge.stop(timeout=30)
    """)
    path = tmp_path / "pinned.py"
    path.write_text(script)
    here = os.path.dirname(os.path.abspath(__file__))  # test_bridge itself, and tests/ for processes
    done = subprocess.run([*prefix, sys.executable, str(path)], capture_output=True, text=True, cwd=here,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)])})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_a_pinned_cpu_engine_and_its_worker_share_no_cpu(llama_dir, tmp_path):
    """Every thread of the engine process (OpenMP's included) on the last CPU, every thread of the worker on the
    others, and the engine's outputs unchanged."""
    got, _ = pinned_run(llama_dir, tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    assert got["pinned"]
    assert got["engine"] == [cpus[-1:]]
    assert got["worker"] == [cpus[:-1]]
    assert got["tokens"] == [o.token_ids for o in LLM(str(llama_dir), **ENGINE).generate(prompts(12), PARAMS)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="lowering a nice value needs root here, and setpriv to take the permission away")
def test_a_pinned_cpu_engine_runs_at_a_lower_nice_value_where_permitted(llama_dir, tmp_path):
    """With CAP_SYS_NICE every engine thread runs at PINNED_ENGINE_NICE and the worker's at its own; without
    it the engine runs on at the worker's value, says so, and serves the same tokens."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    got, _ = pinned_run(llama_dir, tmp_path)
    assert got["engine_nices"] == [PINNED_ENGINE_NICE] and got["reported_nice"] == PINNED_ENGINE_NICE
    assert got["worker_nices"] == [own]
    refused, stderr = pinned_run(llama_dir, tmp_path, ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"])
    assert refused["engine_nices"] == [own] and refused["reported_nice"] == own
    assert f"not permitted nice {PINNED_ENGINE_NICE}" in stderr
    assert refused["tokens"] == got["tokens"]


def test_an_explicit_nice_value_applies_to_every_engine_thread(build):
    """A value above the worker's needs no permission; an unpinned engine takes it too, the caller keeps its own."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    bridge = EngineBridge(build, threads=2, nice=own + 3).start()
    try:
        assert bridge.submit("a", prompts(1)[0], PARAMS).result(timeout=60).token_ids
        assert thread_nices(bridge.process.pid) == {own + 3} and bridge.engine_nice == own + 3
        assert thread_nices(os.getpid()) == {own}
    finally:
        bridge.stop(timeout=30)
