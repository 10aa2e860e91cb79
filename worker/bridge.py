"""Feeds one engine from many threads: a single engine thread alone builds and steps the model; task threads submit
requests and wait on futures. It also cuts the engine's steps into efficiency windows.

The engine is built on its own thread, not handed over from another: an OpenMP worker pool created by one thread
(loading weights runs parallel torch ops) makes the parallel regions another thread starts later wake their workers
slowly, and CPU steps ran 1.7x slower that way (tiny ops 10x).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

from worker.engine import LLMEngine, RequestOutput, RequestRejected, SamplingParams

IDLE_POLL_SECONDS = 0.05


@dataclass
class EfficiencyWindow:
    """Batch efficiency over [start, end): what the engine did and how full it ran."""

    start: float
    end: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    running_sum: int = 0
    max_running: int = 0
    max_num_seqs: int = 0
    token_budget_sum: float = 0.0
    kv_use_sum: float = 0.0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    busy_seconds: float = 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0

    @property
    def occupancy(self) -> float:
        return self.mean_running / self.max_num_seqs if self.max_num_seqs else 0.0

    @property
    def token_budget_use(self) -> float:
        return self.token_budget_sum / self.steps if self.steps else 0.0

    @property
    def kv_cache_use(self) -> float:
        return self.kv_use_sum / self.steps if self.steps else 0.0

    @property
    def idle_seconds(self) -> float:
        return max(self.end - self.start - self.busy_seconds, 0.0)


@dataclass
class _Submit:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float | None
    future: Future


class EngineBridge:
    def __init__(self, build: Callable[[], LLMEngine], window_seconds: float = 10.0,
                 on_window: Callable[[EfficiencyWindow], None] | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput], dict[str, int]], None] | None = None):
        self.build = build
        self.on_step = on_step
        self.engine: LLMEngine | None = None
        self.window_seconds = window_seconds
        self.on_window = on_window
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineBridge:
        """Build the engine on the engine thread and start stepping; raises what building raised."""
        self._thread.start()
        self._ready.wait()
        if self.engine is None:
            raise self.error
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop stepping; requests still in the engine are aborted and their futures raise CancelledError."""
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None) -> Future:
        """Queue a request; the future gets its finished RequestOutput, or RequestRejected."""
        future: Future = Future()
        if self.error is not None or self._stop.is_set():
            future.set_exception(RuntimeError(f"the engine thread is not running ({self.error!r})"))
            return future
        self._inbox.put(_Submit(request_id, prompt, params, priority, arrival_time, future))
        return future

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def _run(self) -> None:
        try:
            self.engine = self.build()
        except BaseException as e:
            self.error = e
            return
        finally:
            self._ready.set()
        self._window = self._new_window(time.time())
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
                self._maybe_close_window()
        except BaseException as e:  # a broken engine must not leave waiters hanging
            self.error = e
        finally:
            self._shutdown()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL_SECONDS) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, str):
            if self.engine.abort(item):
                self._futures.pop(item).set_exception(CancelledError(f"request {item} aborted"))
            return
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_request(item.prompt, item.params, item.request_id, item.priority, item.arrival_time)
        except (RequestRejected, ValueError) as e:
            item.future.set_exception(e if isinstance(e, RequestRejected) else RequestRejected(str(e)))
            return
        self._futures[item.request_id] = item.future

    def _step(self) -> None:
        before = dict(self.engine.counters)
        outputs: list[RequestOutput] = self.engine.step()
        delta = {k: v - before[k] for k, v in self.engine.counters.items()}
        self._account(delta)
        if self.on_step is not None:
            self.on_step(self.engine, outputs, delta)
        for out in outputs:
            if out.finished:
                self._futures.pop(out.request_id).set_result(out)

    def _account(self, delta: dict[str, int]) -> None:
        w, record, config = self._window, self.engine.last_step, self.engine.config
        if record is None:
            return
        w.steps += 1
        w.prefill_tokens += delta["num_prefill_tokens"]
        w.decode_tokens += delta["num_decode_tokens"]
        w.preemptions += delta["num_preemptions"]
        w.prefix_cache_queries += delta["prefix_cache_queries"]
        w.prefix_cache_hits += delta["prefix_cache_hits"]
        w.running_sum += record.num_seqs
        w.max_running = max(w.max_running, record.num_seqs)
        w.token_budget_sum += record.num_tokens / config.max_num_batched_tokens
        w.kv_use_sum += record.kv_blocks_used / self.engine.block_manager.num_blocks
        w.busy_seconds += record.seconds

    def _new_window(self, start: float) -> EfficiencyWindow:
        return EfficiencyWindow(start=start, max_num_seqs=self.engine.config.max_num_seqs)

    def _maybe_close_window(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._window.start < self.window_seconds:
            return
        window, self._window = self._window, self._new_window(now)
        window.end = now
        if self.on_window is not None and (window.steps or not force):
            self.on_window(window)

    def _shutdown(self) -> None:
        self._maybe_close_window(force=True)
        for request_id, future in list(self._futures.items()):
            self.engine.abort(request_id)
            future.set_exception(CancelledError("the engine bridge stopped"))
        self._futures.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, str):
                item.future.cancel()
