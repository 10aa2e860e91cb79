"""`sluice submit`, `status` and `results`: batches through the database and the broker, without the engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sluice.worker.cli.common import (
    UsageError,
    check_readable,
    check_writable,
    database,
    default_errors_path,
    os_problem,
    read_settings,
    write_files,
)


def add_parsers(commands) -> None:
    add_submit_parser(commands)
    add_status_parser(commands)
    add_results_parser(commands)


def add_submit_parser(commands) -> None:
    parser = commands.add_parser(
        "submit", help="submit an OpenAI batch file to the queue",
        description="Store INPUT.jsonl, create a batch of its lines and queue them for the workers of the batch's "
                    "model. Prints the batch id as the last line. Bad lines go to the batch's error file; the batch "
                    "fails only if the file is unusable (exit code 1). Limits, as the API's: SLUICE_MAX_FILE_BYTES "
                    "(200 MB), SLUICE_MAX_BATCH_LINES (50,000).")
    parser.add_argument("input", type=Path, metavar="INPUT.jsonl")
    parser.add_argument("--model", metavar="NAME",
                        help="the served model name to run on (default: the `model` of the lines, one for all)")
    # defaults (priority 5, tenant 'local') live in api.store, which --help does not import
    parser.add_argument("--priority", type=int, metavar="N", help="0 runs first, 9 last (default 5)")
    parser.add_argument("--completion-window", default="24h", metavar="HOURS",
                        help="expire what has not run after this long, e.g. 24h (default)")
    parser.add_argument("--tenant", metavar="NAME", help="the owner of the batch, created if new (default 'local')")
    parser.set_defaults(handler=submit_command)


def submit_command(args: argparse.Namespace) -> int:
    check_readable(args.input)
    from kombu.exceptions import OperationalError

    from sluice.api import queue, store
    from sluice.api.settings import Settings

    # the API's limits, so that a file either takes is a batch for both; the chunk size before the batch is stored
    limits, _ = read_settings(Settings.from_env, queue.chunk_size)
    data = read_limited(args.input, limits.max_file_bytes)
    priority = store.DEFAULT_PRIORITY if args.priority is None else args.priority
    try:
        with database() as session:
            batch, work = store.submit_jsonl(session, args.tenant or store.DEFAULT_TENANT, args.input.name, data,
                                             model=args.model, completion_window=args.completion_window,
                                             priority=priority, max_bytes=limits.max_file_bytes,
                                             max_lines=limits.max_batch_lines,
                                             parents=store.adapter_parents(session))
            waiting = work is not None and not store.live_workers(session, work.model)
    except store.StoreError as e:
        raise UsageError(str(e)) from None
    code = 0
    if batch.status == "failed":
        print(f"sluice submit: batch failed: {batch.errors[0]['message']}", file=sys.stderr)
        code = 1
    else:
        print(f"sluice submit: {batch.request_total - batch.request_failed} requests queued for model "
              f"{batch.model!r}, {batch.request_failed} invalid (`sluice results {batch.id} -o OUT.jsonl` writes "
              "their error lines)",
              file=sys.stderr)
    if work is not None:
        try:
            queue.publish_chunks(queue.make_app(), [work])
        except OperationalError as e:
            print(f"sluice submit: the batch is stored but the broker refused its messages ({e}); the reconciler "
                  "will send them", file=sys.stderr)
            code = 1
    if waiting:
        print(f"sluice submit: no live worker serves {batch.model!r} yet; the requests wait until one starts",
              file=sys.stderr)
    print(batch.id)
    return code


def read_limited(path: Path, max_bytes: int) -> bytes:
    """The file's bytes; a larger file than `max_bytes` is refused having read no more than that, not loaded whole."""
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise os_problem(path, e) from None
    if len(data) > max_bytes:
        raise UsageError(f"{path} is larger than the limit of {max_bytes} bytes (SLUICE_MAX_FILE_BYTES)")
    return data


def add_status_parser(commands) -> None:
    parser = commands.add_parser("status", help="print a batch as JSON (OpenAI's Batch object)")
    parser.add_argument("batch_id", metavar="BATCH_ID")
    parser.set_defaults(handler=status_command)


def status_command(args: argparse.Namespace) -> int:
    from sluice.api import store

    with database() as session:
        try:
            view = store.batch_view(session, store.get_batch(session, args.batch_id))
        except store.NotFound as e:
            raise UsageError(str(e)) from None
    print(json.dumps(view, indent=2))
    return 0


def add_results_parser(commands) -> None:
    parser = commands.add_parser(
        "results", help="write a batch's output and error files",
        description="Write the batch's results in the line format of `sluice run`, in input order. While the batch "
                    "runs, the files hold what has finished so far.")
    parser.add_argument("batch_id", metavar="BATCH_ID")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl",
                        help="successful requests, overwritten")
    parser.add_argument("--errors", type=Path, metavar="ERRORS.jsonl",
                        help="failed requests and invalid lines (default: OUTPUT's name with .errors.jsonl)")
    parser.set_defaults(handler=results_command)


def results_command(args: argparse.Namespace) -> int:
    errors = args.errors or default_errors_path(args.output)
    for path in (args.output, errors):
        check_writable(path)
    if args.output.resolve() == errors.resolve():
        raise UsageError("the output and error files must differ")
    from sluice.api import store

    with database() as session:
        try:
            batch = store.get_batch(session, args.batch_id)
        except store.NotFound as e:
            raise UsageError(str(e)) from None
        written = write_files([(args.output, store.output_lines(session, batch.id)),
                               (errors, store.error_lines(session, batch.id))])
    print(f"sluice results: {written[0]} output lines in {args.output}, {written[1]} error lines in {errors}; "
          f"the batch is {batch.status}", file=sys.stderr)
    return 0

