"""`sluice serve`: the whole service in one command on one machine: the REST API, the queue and a GPU worker in one
process, its engine in a child process of its own (as every GPU worker's).

The same code paths as the distributed setup: the API stores batches and publishes chunk messages through Celery,
an in-process Celery worker (threads pool) runs them on the engine, results and webhooks go through the same store
functions. Only the transports differ: SQLite in --data-dir instead of PostgreSQL, and kombu's in-memory broker
instead of Redis. Messages do not survive a restart but requests do: the reconciler re-sends queued requests
whose queue is empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading
from functools import partial
from pathlib import Path

from sluice.worker.cli.common import (
    UsageError,
    add_engine_args,
    load_engine,
    port,
    read_settings,
    require_engine,
    served_models,
)

KEY_FILE = "api_key"
BROKER_URL = "memory://localhost/"  # with its host named: kombu warns of a missing one at every connection


def add_parsers(commands) -> None:
    parser = commands.add_parser("serve", help="API, queue and worker in one process (SQLite, no Redis needed)")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--data-dir", type=Path, default=Path(".sluice"),
                        help=f"the database and the API key file ({KEY_FILE}) live here (default ./.sluice)")
    parser.add_argument("--loglevel", default="WARNING")
    parser.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    require_engine()
    from sluice.api.queue import chunk_size, reconcile_seconds
    from sluice.api.settings import Settings
    from sluice.api.store import gpu_hour_cost

    settings, *_ = read_settings(Settings.from_env, chunk_size, gpu_hour_cost, reconcile_seconds)
    served = served_models(args)
    try:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, or no permission
        raise UsageError(f"--data-dir {args.data_dir}: {e.strerror or e}") from None
    listener = bind(args.host, args.port)  # a port in use is an error now, not after the engine is built
    # before anything reads them: worker.celery_app builds its Celery app from the environment at import
    os.environ["SLUICE_DATABASE_URL"] = f"sqlite:///{(args.data_dir / 'sluice.db').resolve()}"
    os.environ["SLUICE_BROKER_URL"] = BROKER_URL
    import uvicorn
    from sqlalchemy.exc import OperationalError

    from sluice.api import db
    from sluice.api.queue import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE, model_queue
    from sluice.api.server import create_app
    from sluice.worker.celery_app import app as celery
    from sluice.worker.cli.worker import serve_queues
    from sluice.worker.gpu_worker import GpuWorker, WorkerSettings

    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    celery.conf.broker_transport_options = {**celery.conf.broker_transport_options, "polling_interval": 0.05}
    database = db.make_engine()
    try:
        db.upgrade(database)
        sessions = db.session_factory(database)
        key = local_key(sessions, args.data_dir / KEY_FILE)
    except (OperationalError, OSError) as e:  # a directory it may not write in, a database file it may not open
        problem = e.orig if isinstance(e, OperationalError) else e.strerror or e
        raise UsageError(f"--data-dir {args.data_dir}: cannot keep the database and API key there: {problem}") from None
    name, adapters = served.base, served.adapters
    worker = GpuWorker(partial(load_engine, args), WorkerSettings(name, args.model, adapters), sessions,
                       celery).start()
    api = create_app(sessions, celery, dataclasses.replace(settings, models=tuple(served.names),
                                                           adapter_parents=dict.fromkeys(adapters, name)))
    server = uvicorn.Server(uvicorn.Config(api, host=args.host, port=args.port, log_level=args.loglevel.lower()))
    threading.Thread(target=server.run, args=([listener],), name="api", daemon=True).start()
    also = f" with LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
    print(f"sluice serve: model {name!r}{also} at http://{args.host}:{args.port}/v1 ; API key in "
          f"{args.data_dir / KEY_FILE}:\n{key}", file=sys.stderr)
    try:
        serve_queues(worker, celery, [*map(model_queue, served.names), WEBHOOKS_QUEUE, MAINTENANCE_QUEUE],
                     args.loglevel, "serve")
    finally:
        server.should_exit = True
    return 0


def bind(host: str, port: int) -> socket.socket:
    """The API's socket, bound to `host`:`port` as uvicorn binds it (it listens once the API starts)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


def local_key(sessions, path: Path) -> str:
    """The API key of the tenant `local`, made on the first start and kept (mode 600) in the data directory."""
    from sluice.api import store

    if path.exists():
        key = path.read_text().strip()
        with sessions.begin() as session:
            if store.resolve_api_key(session, key) is not None:
                return key
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, store.DEFAULT_TENANT)
        _, key = store.create_api_key(session, tenant.id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    os.fchmod(fd, 0o600)  # a file that was there already keeps its mode through O_CREAT
    with open(fd, "w") as file:
        file.write(key + "\n")
    return key
