"""`sluice worker`: a GPU worker process, one engine fed by a Celery worker on the model's queue (threads pool), and
on the queue of each LoRA adapter it serves.

The engine is built and stepped in a child process started with spawn (worker/engine_process.py), and this process
never initialises CUDA nor forks (the threads pool never forks), so CUDA is initialised once, where it is used.
SIGTERM is Celery's warm shutdown: no new messages are taken, running chunks get a grace period to finish, then
their requests are given back and their messages requeued.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from functools import partial

from sluice.worker.cli.common import (
    UsageError,
    add_engine_args,
    load_engine,
    make_db_engine,
    port,
    read_settings,
    require_engine,
    served_models,
)


def add_parsers(commands) -> None:
    parser = commands.add_parser("worker", help="run a GPU worker on the queue of its model")
    add_engine_args(parser)
    ops = parser.add_argument_group("worker")
    ops.add_argument("--concurrency", type=int, metavar="N",
                     help="chunks run at once (default: enough to fill max_num_seqs twice over)")
    ops.add_argument("--lease-seconds", type=float, default=60.0, metavar="S",
                     help="a claimed request returns to the queue this long after its worker stops renewing it")
    ops.add_argument("--reconcile-seconds", type=float, default=30.0, metavar="S",
                     help="how often this worker also runs the reconciler")
    ops.add_argument("--stale-seconds", type=float, default=30.0, metavar="S",
                     help="re-send queued requests published this long ago when their queue is empty (lost messages)")
    ops.add_argument("--shutdown-grace-seconds", type=float, default=30.0, metavar="S",
                     help="on SIGTERM, how long running chunks may take before their requests are given back")
    ops.add_argument("--window-seconds", type=float, default=10.0, metavar="S",
                     help="length of the engine efficiency windows this worker records (steps, occupancy, busy and "
                          "idle seconds); shorter ones show a short run's ramp and any gaps in feeding the engine")
    ops.add_argument("--metrics-port", type=port, metavar="PORT",
                     help="serve the engine's live Prometheus metrics on this port (sluice:engine_*)")
    ops.add_argument("--engine-threads", type=int, metavar="N",
                     help="PyTorch threads of the engine process (default: all CPUs but one, left to the worker)")
    ops.add_argument("--no-cpu-pinning", dest="cpu_pinning", action="store_false",
                     help="let the OS place a CPU engine's threads and the worker's (default: the engine's threads "
                          "get the last CPUs to themselves, the worker the rest)")
    ops.add_argument("--engine-nice", type=int, metavar="N",
                     help="nice value of the engine process, -20 to 19 (default: -10 for a CPU engine pinned to CPUs "
                          "of its own, so that other processes woken there yield them; unchanged otherwise). "
                          "Lowering it needs CAP_SYS_NICE: without it the engine keeps the worker's, as the log says")
    ops.add_argument("--loglevel", default="INFO")
    parser.set_defaults(handler=worker_command)


def worker_command(args: argparse.Namespace) -> int:
    require_engine()
    from sqlalchemy.exc import SQLAlchemyError

    from sluice.api import db, store
    from sluice.api.queue import chunk_size, model_queue, reconcile_seconds

    read_settings(chunk_size, store.gpu_hour_cost, reconcile_seconds)  # before worker.celery_app reads the last
    from sluice.worker.celery_app import app
    from sluice.worker.engine.config import EngineConfig
    from sluice.worker.gpu_worker import GpuWorker, WorkerSettings

    if args.engine_threads is not None and args.engine_threads < 1:
        raise UsageError(f"--engine-threads must be at least 1, got {args.engine_threads}")
    if args.window_seconds <= 0:
        raise UsageError(f"--window-seconds must be positive, got {args.window_seconds}")
    if args.engine_nice is not None and not -20 <= args.engine_nice <= 19:
        raise UsageError(f"--engine-nice must be from -20 to 19, got {args.engine_nice}")
    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    served = served_models(args)
    settings = WorkerSettings(served.base, args.model, served.adapters, lease_seconds=args.lease_seconds,
                              reconcile_seconds=args.reconcile_seconds, stale_seconds=args.stale_seconds,
                              shutdown_grace_seconds=args.shutdown_grace_seconds, window_seconds=args.window_seconds,
                              metrics_port=args.metrics_port, engine_threads=args.engine_threads,
                              cpu_pinning=args.cpu_pinning, engine_nice=args.engine_nice)
    concurrency = args.concurrency or default_concurrency(args.max_num_seqs or EngineConfig.max_num_seqs)
    # a connection for each chunk's thread, the maintenance thread and the consumer's (it marks the worker live)
    database = make_db_engine(pre_ping=False, pool_size=concurrency + 2)
    worker = GpuWorker(partial(load_engine, args), settings, db.session_factory(database), app)
    try:
        worker.start()  # builds the engine on its own thread; a bad model or adapter is load_engine's UsageError
    except SQLAlchemyError as e:
        raise UsageError(f"cannot reach the database ({db.database_url()}): {e}") from None
    serve_queues(worker, app, [model_queue(name) for name in served.names], args.loglevel, "gpu", concurrency)
    return 0


def default_concurrency(max_num_seqs: int) -> int:
    """Chunks run at once: enough to fill max_num_seqs twice over."""
    from sluice.api.queue import chunk_size

    return 2 * -(-max_num_seqs // chunk_size())


def serve_queues(worker, app, queues: list[str], loglevel: str, prefix: str, concurrency: int | None = None) -> None:
    """Run a Celery worker (threads pool) on `queues` in this thread, feeding `worker`'s engine; on SIGTERM or Ctrl-C
    its chunks get the grace period, a second Ctrl-C (or a SIGQUIT) stops the engine at once, so that they give their
    requests back now, and the GPU worker is closed when Celery exits."""
    from celery.apps.worker import safe_say
    from celery.exceptions import Reject
    from celery.signals import worker_ready, worker_shutting_down

    from sluice.worker import gpu_worker

    interrupted = []  # Ctrl-C came once

    def quiet_reject(record: logging.LogRecord) -> bool:
        """Celery logs a task that raised Reject (a chunk given back by a stopping worker) with its traceback, one
        a chunk: the message says all there is to say."""
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info = None
        return True

    def stop_now() -> None:
        safe_say("worker: stopping the engine now: running requests go back to the queue", sys.__stdout__)
        threading.Thread(target=worker.bridge.stop, name="stop-engine", daemon=True).start()

    def on_ready(**_) -> None:
        worker.mark_consuming()  # live only once it takes messages
        # Celery's second Ctrl-C (and SIGQUIT) is a cold shutdown, which kills the pool's running tasks: a threads
        # pool cannot (NotImplementedError, a traceback), and its chunks waited out the grace period all the same.
        # Here a first Ctrl-C is SIGTERM's warm shutdown, and a second one stops the engine
        warm = signal.getsignal(signal.SIGTERM)

        def on_interrupt(signum, frame) -> None:
            if interrupted:
                stop_now()
                return
            interrupted.append(signum)
            safe_say("worker: hitting Ctrl+C again stops the engine at once", sys.__stdout__)
            warm(signum, frame)

        def on_quit(signum, frame) -> None:
            interrupted.append(signum)
            warm(signum, frame)
            stop_now()

        signal.signal(signal.SIGINT, on_interrupt)
        signal.signal(signal.SIGQUIT, on_quit)

    gpu_worker.install(worker)
    logging.getLogger("celery.app.trace").addFilter(quiet_reject)
    worker_shutting_down.connect(lambda **_: worker.begin_shutdown(), weak=False)
    worker_ready.connect(on_ready, weak=False)
    concurrency = concurrency or default_concurrency(worker.processor.config.max_num_seqs)
    try:
        app.worker_main(["worker", "-Q", ",".join(queues), "-P", "threads", "-c", str(concurrency),
                         "-n", f"{prefix}-{worker.id}@%h", "--loglevel", loglevel, "--without-gossip",
                         "--without-mingle"])
    finally:
        worker.close()
        gpu_worker.install(None)
