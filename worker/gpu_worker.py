"""The GPU worker: one engine behind a bridge, Celery task threads feeding it chunks of requests, and its maintenance
(leases, heartbeats, efficiency windows, reconciliation: worker/maintenance.py) running beside them.

A chunk is claimed (queued -> running under a lease), run, and its results written in one transaction before
the task returns, so Celery acks the message only once the results are stored (acks_late).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, wait
from dataclasses import dataclass, field

from celery import Celery
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from sluice.api import store
from sluice.api.batch_lines import BODIES, Body
from sluice.api.dispatch import dispatch
from sluice.worker.adapters import ServedModels, UnknownModel
from sluice.worker.bridge import EngineBridge, EngineNotRunning
from sluice.worker.engine import LLMEngine, RequestOutput, RequestRejected
from sluice.worker.engine_process import freeze_heap
from sluice.worker.engine_protocol import Submit
from sluice.worker.fingerprint import Fingerprints
from sluice.worker.maintenance import Maintenance
from sluice.worker.metrics import EngineMetrics
from sluice.worker.reconcile import STALE_SECONDS
from sluice.worker.retry import retry_transient
from sluice.worker.structured import grammar_param
from sluice.worker.translate import PromptError, Responses, engine_inputs


@dataclass
class WorkerSettings:
    served_model_name: str
    model: str
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters: served name -> directory
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    reconcile_seconds: float = 30.0
    stale_seconds: float = STALE_SECONDS
    shutdown_grace_seconds: float = 30.0
    window_seconds: float = 10.0
    metrics_port: int | None = None
    engine_threads: int | None = None  # PyTorch threads of the engine process (default: all CPUs but one)
    cpu_pinning: bool = True  # a CPU engine and this process on disjoint CPUs (worker/cpus.py)
    engine_nice: int | None = None  # the engine process's nice value (default: -10 when pinned, else unchanged)


@dataclass
class ChunkOutcome:
    finished: list[int]
    released: list[int]


class GpuWorker:
    def __init__(self, build_engine: Callable[[], LLMEngine], settings: WorkerSettings,
                 sessions: sessionmaker[Session], app: Celery):
        self.settings, self.sessions, self.app = settings, sessions, app
        self.served = ServedModels.of(settings.served_model_name, settings.adapters)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.maintenance = Maintenance(self)
        self.metrics = EngineMetrics(settings.served_model_name)
        self.bridge = EngineBridge(build_engine, settings.window_seconds, on_window=self.maintenance.windows.put,
                                   on_step=self.metrics.observe, threads=settings.engine_threads,
                                   pin_cpus=settings.cpu_pinning, nice=settings.engine_nice)
        self.in_flight: set[int] = set()
        self.lock = threading.Lock()
        self.consuming = threading.Event()  # Celery consumes the model's queue: the worker is live
        self.stopping = threading.Event()
        self._grace: threading.Timer | None = None  # stops the engine when SIGTERM's grace period runs out
        # a claim is one UPDATE: on PostgreSQL it commits on its own, without the BEGIN and COMMIT round trips of a
        # transaction, two of a chunk's nine (SQLite's writers keep their BEGIN IMMEDIATE, api.db)
        bind = sessions.kw["bind"]
        self._autocommit = (bind.execution_options(isolation_level="AUTOCOMMIT")
                            if bind.dialect.name == "postgresql" else None)

    def start(self) -> GpuWorker:
        store.gpu_hour_cost()  # a bad SLUICE_GPU_HOUR_COST fails at start, not at the first result
        self.bridge.start()
        self.processor = self.bridge.processor
        self.responses = Responses(self.processor.tokenizer)
        self.fingerprints = Fingerprints(self.bridge.fingerprint, self.served)
        if self.settings.metrics_port is not None:
            self.metrics.serve(self.settings.metrics_port)
        self.maintenance.heartbeat()  # starting: live once Celery consumes the queue (mark_consuming)
        freeze_heap()  # the worker's own heap (Celery, SQLAlchemy, transformers) likewise; not measured apart
        self.maintenance.start()
        return self

    def mark_consuming(self) -> None:
        """Celery's consumer is ready: from now on a message for this model is taken, so the worker is live."""
        self.consuming.set()
        self.maintenance.heartbeat()

    def status(self) -> str:
        return "stopping" if self.stopping.is_set() else "running" if self.consuming.is_set() else "starting"

    def in_flight_ids(self) -> list[int]:
        """The requests this worker's chunks are running now, in id order."""
        with self.lock:
            return sorted(self.in_flight)

    # --- a chunk, on a Celery task thread

    def run_chunk(self, request_ids: list[int]) -> ChunkOutcome:
        if self.stopping.is_set():
            return ChunkOutcome([], list(request_ids))
        with self.lock:  # one this worker runs already, sent again after its lease ran out while renewals failed:
            # the chunk running it stores its result; claimed here, the engine would refuse its id as a duplicate
            request_ids = [i for i in request_ids if i not in self.in_flight]
        claimed = self._claim(request_ids)
        with self.lock:
            self.in_flight.update(c.id for c in claimed)
        try:
            results, aborted, unrun = self._run(claimed)
            finished = self.db(lambda s: store.write_results(s, results, self.id))
            released = self._settle_aborted(aborted, unrun)
        finally:
            with self.lock:
                self.in_flight.difference_update(c.id for c in claimed)
        return ChunkOutcome(finished, released)

    def _claim(self, request_ids: list[int]) -> list[store.Claimed]:
        claim = lambda db: store.claim(db, request_ids, self.id, self.settings.lease_seconds)
        if self._autocommit is None:
            return self.db(claim)

        def once() -> list[store.Claimed]:
            with self._autocommit.connect() as connection:
                return claim(connection)
        return retry_transient(once)

    def _run(self, claimed: list[store.Claimed]) -> tuple[list[store.RequestResult], list[int], list[int]]:
        """Results, the ids aborted in the engine, and those it never took (it had stopped or died)."""
        results, runnable, submits = [], [], []
        for c in claimed:
            try:
                name, lora = self.served.resolve(c.body.get("model") or c.model)
            except UnknownModel as e:  # a worker of its base model that does not serve this adapter
                results.append(_error(c, "model_not_found", str(e), "body.model"))
                continue
            try:
                body = BODIES[c.url].model_validate(c.body)
                token_ids, params = engine_inputs(self.processor, c.url, body)
                # the text is decoded here on a task thread (Responses), not token by token in the engine's
                # process, whose every CPU cycle is a step (vLLM V1 likewise detokenizes outside its engine
                # core); stop strings are matched in the text, so those requests keep it in the engine
                params.detokenize = bool(params.stop)
            except (PromptError, ValidationError) as e:
                results.append(_error(c, getattr(e, "code", "invalid_value"), str(e), getattr(e, "param", "body")))
                continue
            runnable.append((c, body, name))
            submits.append(Submit(str(c.id), token_ids, params, c.priority, c.created_at, lora))
        aborted, unrun = [], []
        futures = self.bridge.submit_many(submits)
        wait(futures)  # woken once, when the last has finished, rather than for each in turn
        for (c, body, name), future in zip(runnable, futures):
            try:
                out = future.result()
            except RequestRejected as e:
                results.append(_error(c, e.code, str(e), "body"))
            except EngineNotRunning:
                unrun.append(c.id)
            except CancelledError:
                aborted.append(c.id)
            else:
                results.append(self._result(c, body, name, out) if out.error is None
                               else _error(c, "invalid_value", out.error, grammar_param(body)))
        return results, aborted, unrun

    def _result(self, c: store.Claimed, body: Body, name: str, out: RequestOutput) -> store.RequestResult:
        m = out.metrics
        since = lambda t: None if t is None else max(t - c.created_at, 0.0)
        response = self.responses.response(c.url, body, out, name, self.fingerprints.of(name))
        return store.RequestResult(c.id, response=response, prompt_tokens=len(out.prompt_token_ids),
                                   cached_tokens=out.num_cached_tokens, completion_tokens=out.num_completion_tokens,
                                   queue_seconds=since(m.first_scheduled_time), ttft_seconds=since(m.first_token_time),
                                   e2e_seconds=since(m.finish_time), gpu_seconds=m.gpu_seconds)

    def _settle_aborted(self, aborted: list[int], unrun: list[int]) -> list[int]:
        """Never run, or aborted because this worker is stopping: give them back (returned: their message is
        requeued); aborted because their batch is cancelling: record it (expired ones already have their error
        result, and taken-over ones belong to another worker now). Those running when the engine died are neither:
        their lease runs out and counts as an attempt, since they may be what killed it."""
        if self.stopping.is_set() and self.bridge.error is None:
            unrun, aborted = unrun + aborted, []
        if aborted:
            self.db(lambda s: store.mark_cancelled(s, aborted, self.id))
        return self.db(lambda s: store.release(s, unrun, self.id)) if unrun else []

    # --- shutdown

    def begin_shutdown(self) -> None:
        """Take no new chunks; let running ones finish for the grace period, then give their requests back."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.maintenance.heartbeat()
        # a daemon, cancelled by close(): a worker whose chunks all finished early must not wait out the grace
        # period (30 s by default, more than `docker stop` gives before its SIGKILL) before its process can exit
        self._grace = threading.Timer(self.settings.shutdown_grace_seconds, self.bridge.stop)
        self._grace.daemon = True
        self._grace.start()

    def close(self) -> None:
        self.stopping.set()
        if self._grace is not None:
            self._grace.cancel()
        self.bridge.stop(timeout=30)
        self.maintenance.stop()
        self.maintenance.heartbeat("stopped")

    def db(self, work):
        """Run `work(session)` in a transaction, retrying transient database errors with backoff; webhooks the
        transaction wrote (a batch finished or was cancelled) are published once it has committed."""
        def transaction():
            with self.sessions.begin() as session:
                result = work(session)
                deliveries = store.new_deliveries(session)
            # committed: a broker that is down must not fail the chunk now (its results are stored); the delivery
            # sweep sends them later
            dispatch(self.app, [], deliveries)
            return result
        return retry_transient(transaction)


def _error(c: store.Claimed, code: str, message: str, param: str | None) -> store.RequestResult:
    return store.RequestResult(c.id, error={"code": code, "message": message, "param": param}, status_code=400)


_current: GpuWorker | None = None


def current() -> GpuWorker | None:
    """The GPU worker of this process, if it is one (the CPU worker for webhooks has none)."""
    return _current


def install(worker: GpuWorker | None) -> None:
    global _current
    _current = worker
