"""`sluice api`: the REST API server; imports api/ only, never torch."""

from __future__ import annotations

import argparse

from sluice.worker.cli.common import UsageError, port, read_settings


def add_parsers(commands) -> None:
    parser = commands.add_parser(
        "api", help="run the REST API server",
        description="Serve the OpenAI-compatible Files and Batches API and sluice's own routes over "
                    "SLUICE_DATABASE_URL and SLUICE_BROKER_URL. Limits: SLUICE_MAX_FILE_BYTES, SLUICE_MAX_BATCH_LINES; "
                    "models accepted before their workers are up: SLUICE_MODELS (comma-separated); /metrics token: "
                    "SLUICE_METRICS_TOKEN.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    parser.set_defaults(handler=api_command)


def api_command(args: argparse.Namespace) -> int:
    from sluice.api.queue import chunk_size
    from sluice.api.server import serve

    read_settings(chunk_size)  # else read only as a batch is published, after it was stored
    try:
        serve(args.host, args.port)
    except ValueError as e:  # a malformed SLUICE_* setting
        raise UsageError(str(e)) from None
    return 0
