"""Feeds the engine's process (worker/engine_process.py) from many threads: task threads submit requests and wait on
futures; one receiver thread resolves them from the engine's reports, feeds the live metrics and hands on the
efficiency windows. Requests are tokenized and checked here, with an InputProcessor of the engine's own settings,
so only token ids cross to the engine.

The engine process is started with "spawn": nothing CUDA or OpenMP from this process is inherited, and the engine
is built, and stepped, on the one thread of a fresh process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path

from sluice.worker.cpus import pin_threads, split_cpus
from sluice.worker.efficiency import EfficiencyWindow
from sluice.worker.engine import InputProcessor, LLMEngine, RequestRejected, SamplingParams
from sluice.worker.engine_process import run_engine
from sluice.worker.engine_protocol import Abort, Failed, LiveStats, Report, Stop, Submit
from sluice.worker.fingerprint import Fingerprint

log = logging.getLogger(__name__)


def default_engine_threads() -> int:
    """Every CPU this process may use but one, which the worker's own threads, database and broker clients need: a
    CPU engine given them all has its parallel regions stalled whenever the worker runs (bench/queue_overhead.py).
    A CUDA engine barely uses them."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class EngineNotRunning(RuntimeError):
    """A request submitted after the engine stopped or died: it never ran, so another worker may run it."""


class EngineBridge:
    def __init__(self, build: Callable[[], LLMEngine], window_seconds: float = 10.0,
                 on_window: Callable[[EfficiencyWindow], None] | None = None,
                 on_step: Callable[[LiveStats], None] | None = None, threads: int | None = None,
                 pin_cpus: bool = False, nice: int | None = None):
        """`build` makes the engine in the engine process, so it must pickle (a function, or a partial of one);
        `threads` is the engine's PyTorch thread count (default_engine_threads()). `pin_cpus`: a CPU engine and
        this whole process (every thread of it) get disjoint CPUs (split_cpus), so the worker's Python never
        preempts the engine's OpenMP threads mid parallel region; it applies only once the engine is built on
        the CPU, and it pins the calling process, so only a process that is a worker should ask. `nice`: the
        engine process's nice value (default: worker.cpus.PINNED_ENGINE_NICE for a pinned CPU engine, else
        unchanged); where lowering it is not permitted the engine runs on at the worker's, and says so (a warning if
        `nice` was given, else at INFO)."""
        self.build, self.window_seconds = build, window_seconds
        self.threads = threads or default_engine_threads()
        self.split = split_cpus(self.threads) if pin_cpus else None
        self.nice = nice
        self.pinned = False
        self.engine_nice = 0  # what the engine process runs at, once started
        self.on_window, self.on_step = on_window, on_step
        self.processor: InputProcessor | None = None
        self.fingerprint: Fingerprint | None = None  # the engine's, once started
        self.error: BaseException | None = None
        self.final_stats: dict | None = None  # the engine's stats() as it stopped
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._receiver = threading.Thread(target=self._receive, name="engine-reports", daemon=True)

    def start(self) -> EngineBridge:
        """Start the engine process and wait until it has built the engine; raises what building raised."""
        ctx = multiprocessing.get_context("spawn")
        requests_in, self._requests = ctx.Pipe(duplex=False)
        self._reports, reports_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_engine, name="sluice-engine", daemon=True,
                                   args=(self.build, requests_in, reports_out, self.window_seconds, self.threads,
                                         self.split and self.split[1], self.nice))
        self.process.start()
        requests_in.close()  # only the engine holds these ends: either side sees EOF when the other dies
        reports_out.close()
        try:
            first = self._reports.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while building "
                               "the engine") from None
        if isinstance(first, Failed):
            self.process.join()
            raise first.error
        self.processor = InputProcessor.load(Path(first.path), first.config, first.num_kv_blocks)
        self.fingerprint = first.fingerprint
        if first.pinned:
            pin_threads(self.split[0])
            self.pinned = True
        self.engine_nice = first.nice
        if first.nice_refused is not None:  # a warning where it was asked for, a note where it was the default
            log.log(logging.INFO if self.nice is None else logging.WARNING,
                    "the engine process was not permitted nice %d (lowering it needs CAP_SYS_NICE); it runs at %d, "
                    "and other processes woken on its CPUs may preempt it", first.nice_refused, first.nice)
        self._receiver.start()
        return self

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None) -> Future:
        """Queue a request; the future gets its finished RequestOutput, RequestRejected, EngineNotRunning, or
        CancelledError (aborted, or the engine stopped or died while running it)."""
        return self.submit_many([Submit(request_id, prompt, params, priority, arrival_time)])[0]

    def submit_many(self, requests: list[Submit]) -> list[Future]:
        """Queue requests in one message to the engine (a chunk's worth: one pipe write, not one per request)."""
        futures, accepted = [Future() for _ in requests], []
        with self._lock:
            for request, future in zip(requests, futures):
                if self.error is not None or self._stopped:
                    future.set_exception(EngineNotRunning(f"the engine is not running ({self.error!r})"))
                elif request.request_id in self._futures:
                    future.set_exception(RequestRejected(f"request_id {request.request_id!r} is already in the engine"))
                else:
                    self._futures[request.request_id] = future
                    accepted.append(request)
            if accepted:
                self._send(accepted)
        return futures

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._send(Abort(request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine; requests still in it are aborted and their futures raise CancelledError."""
        with self._lock:
            self._stopped = True
            self._send(Stop())
        if self._receiver.is_alive():
            self._receiver.join(timeout)
        if hasattr(self, "process"):
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    def _send(self, message) -> None:
        try:
            self._requests.send(message)
        except (OSError, ValueError):  # the engine process is gone; the receiver reports why
            pass

    def _receive(self) -> None:
        try:
            while True:
                report = self._reports.recv()
                if isinstance(report, Failed):
                    self.error = report.error
                    return
                self._apply(report)
                if report.final_stats is not None:
                    self.final_stats = report.final_stats
                    return
        except (EOFError, OSError):
            self.error = RuntimeError(f"the engine process died (exit code {self.process.exitcode})")
        finally:
            with self._lock:
                self._stopped = True
                futures, self._futures = self._futures, {}
            for future in futures.values():
                future.set_exception(CancelledError("the engine stopped"))

    def _apply(self, report: Report) -> None:
        with self._lock:
            pop = self._futures.pop
            settled = [(pop(out.request_id, None), out) for out in report.finished]
            failed = [(pop(request_id, None), error) for request_id, error in report.rejected]
            failed += [(pop(request_id, None), CancelledError(f"request {request_id} aborted"))
                       for request_id in report.cancelled]
        for future, out in settled:
            if future is not None:
                future.set_result(out)
        for future, error in failed:
            if future is not None:
                future.set_exception(error)
        if report.live is not None and self.on_step is not None:
            self.on_step(report.live)
        if report.window is not None and self.on_window is not None:
            self.on_window(report.window)
