"""The engine's own process (vLLM V1's EngineCore): builds the model, steps it, and reports what happened.

A GPU worker's task threads tokenize, talk to Postgres and Celery, and build response bodies; sharing one process
(one GIL) with them made every engine step about 3x slower (bench/queue_overhead.py). Here the engine has its
process to itself. It reads requests and aborts from one pipe and writes a Report per step to another
(worker/engine_protocol.py); it exits when the worker asks it to, or when the request pipe closes because the
worker died.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from sluice.worker.cpus import PINNED_ENGINE_NICE, pin_threads, set_nice
from sluice.worker.efficiency import EfficiencyWindow
from sluice.worker.engine import LLMEngine, RequestOutput, RequestRejected
from sluice.worker.engine.stats import StepStats
from sluice.worker.engine_protocol import Abort, Failed, LiveStats, Ready, Report, Stop, Submit
from sluice.worker.fingerprint import engine_fingerprint

IDLE_POLL_SECONDS = 0.05


def run_engine(build: Callable[[], LLMEngine], requests: Connection, reports: Connection,
               window_seconds: float, threads: int, cpus: set[int] | None = None, nice: int | None = None) -> None:
    """The process's target; `threads` is PyTorch's intra-op thread count here; a CPU engine pins itself to
    `cpus` when given (a CUDA engine's few CPU threads are better left free to move). `nice`: the process's
    nice value; None takes PINNED_ENGINE_NICE where the engine pinned itself and leaves it unchanged otherwise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the worker decides
    torch.set_num_threads(threads)
    try:
        engine = build()
    except BaseException as e:  # noqa: BLE001 - whatever it is, the worker must hear of it
        _send_failure(reports, e)
        return
    pinned = bool(cpus) and engine.config.torch_device().type == "cpu"
    if pinned:
        pin_threads(cpus)  # OpenMP's pool may already exist (building ran parallel ops): every thread, not just this
    if nice is None and pinned:
        nice = PINNED_ENGINE_NICE
    refused = nice if nice is not None and not set_nice(nice) else None
    reports.send(Ready(str(engine.path), engine.config, engine.block_manager.num_blocks, engine_fingerprint(engine),
                       pinned, os.getpriority(os.PRIO_PROCESS, 0), refused))
    freeze_heap()
    EngineCore(engine, requests, reports, window_seconds).loop()


YOUNG_GC_THRESHOLD = 20_000  # allocations less deallocations between young collections (CPython's default: 700)


def freeze_heap() -> None:
    """Leave everything alive now (modules, the model, the tokenizer) out of every later garbage collection: the
    full collections that the steady stream of requests triggers would otherwise walk it all, between steps or
    inside them (bench/NOTES.md has the figures).

    Then collect the young generation less often. A request's objects (its body, token lists, futures, result rows)
    live for a chunk's run, a few hundred milliseconds: at CPython's 700 they are walked by one young collection
    after another and promoted before they die. At YOUNG_GC_THRESHOLD nearly all of them die first, freed by their
    reference counts; only reference cycles wait longer to be freed."""
    gc.collect()
    gc.freeze()
    # frozen objects are never collected, not even at exit, where nanobind (Triton's bindings) then reports them all
    # as leaked: thaw them before the interpreter tears down
    atexit.register(gc.unfreeze)
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def _latencies(finished: list[RequestOutput]) -> list[tuple[float, float]]:
    """(TTFT, end to end) of finished requests. Their arrival is the request's creation on the API host's clock: one
    ahead of this host's must not give negative figures (the stored results are clamped likewise, gpu_worker)."""
    return [(max(m.first_token_time - m.arrival_time, 0.0), max(m.finish_time - m.arrival_time, 0.0))
            for m in (o.metrics for o in finished) if m.first_token_time is not None]


def _send_failure(reports: Connection, error: BaseException) -> None:
    try:
        reports.send(Failed(error))
    except Exception:  # an exception that does not pickle still gets its message across
        reports.send(Failed(RuntimeError(f"{type(error).__name__}: {error}")))


class EngineCore:
    """The loop of the engine process: take in messages, step the engine while it has work, report."""

    def __init__(self, engine: LLMEngine, requests: Connection, reports: Connection, window_seconds: float):
        self.engine, self.requests, self.reports = engine, requests, reports
        self.window_seconds = window_seconds
        self.window = self._new_window(time.time())
        self.report = Report()
        self.stopping = False

    def loop(self) -> None:
        try:
            while not self.stopping:
                self._read(wait=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests() and not self.stopping:
                    self._step()
                self._close_window()
                self._flush()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the worker is gone: nobody is left to report to
        except BaseException as e:  # noqa: BLE001 - a broken engine must not leave the worker waiting
            _send_failure(self.reports, e)
            return
        self._stop()

    def _read(self, wait: bool) -> None:
        if not self.requests.poll(IDLE_POLL_SECONDS if wait else 0):
            return
        while True:
            self._handle(self.requests.recv())  # EOFError here: the worker died
            if self.stopping or not self.requests.poll(0):
                return

    def _handle(self, message) -> None:
        if isinstance(message, list):  # of Submit
            for submit in message:
                self._add(submit)
        elif isinstance(message, Abort):
            if self.engine.abort(message.request_id):
                self.report.cancelled.append(message.request_id)
        elif isinstance(message, Stop):
            self.stopping = True

    def _add(self, submit: Submit) -> None:
        try:
            self.engine.add_request(submit.prompt, submit.params, submit.request_id, submit.priority,
                                    submit.arrival_time, lora_request=submit.lora)
        except (RequestRejected, ValueError) as e:  # ValueError: also an adapter that cannot be read (ModelError)
            self.report.rejected.append((submit.request_id, e if isinstance(e, RequestRejected)
                                         else RequestRejected(str(e))))

    def _step(self) -> None:
        finished = self.engine.step(finished_only=True)  # outputs of unfinished requests would only be dropped here
        self.report.finished += finished
        step = self.engine.last_step
        if step is None:
            return
        self.window.add(step)
        self.report.live = self._live(step, _latencies(finished))

    def _live(self, step: StepStats | None = None, latencies: list[tuple[float, float]] | None = None) -> LiveStats:
        engine, bm = self.engine, self.engine.block_manager
        return LiveStats(len(engine.scheduler.running), engine.scheduler.num_waiting, bm.num_used_blocks,
                         bm.num_blocks, step, latencies or [])

    def _new_window(self, start: float) -> EfficiencyWindow:
        config = self.engine.config
        return EfficiencyWindow(start, config.max_num_seqs, config.max_num_batched_tokens,
                                self.engine.block_manager.num_blocks)

    def _close_window(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self.window.start < self.window_seconds:
            return
        window, self.window = self.window, self._new_window(now)
        window.end = now
        if window.steps or not force:
            self.report.window = window

    def _flush(self) -> None:
        if self.report.cancelled and self.report.live is None:
            # aborts free sequences and blocks, and an idle engine runs no step to say so: without this the live
            # gauges would show the aborted requests running, and their KV blocks used, until the next request
            self.report.live = self._live()
        if self.report:
            self.reports.send(self.report)
            self.report = Report()

    def _stop(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self.report.cancelled.append(request_id)
        self._close_window(force=True)
        self.report.final_stats = self.engine.stats()
        self._flush()
