"""The `sluice` command line: argparse subcommands, each one a parser function and a handler function."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine import LLMEngine

ENGINE_FLAGS = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                "quantization", "quantization_group_size", "kv_cache_dtype")


class UsageError(Exception):
    """A mistake in the command itself: reported on stderr with exit code 2, without a traceback."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except UsageError as e:
        print(f"sluice {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. while the model loads; `sluice run` reports one mid-run itself
        print(f"\nsluice {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader has gone (`| head`): stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit raises nothing
        return 1


def port(text: str) -> int:
    """argparse type of a TCP port."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def os_problem(path: Path, e: OSError) -> UsageError:
    """An OSError as one line naming the path: 'out.jsonl: Permission denied'."""
    return UsageError(f"{path}: {e.strerror or e}")


def read_settings(*readers):
    """The SLUICE_* settings a command needs, read before it stores or loads anything: a malformed one is one line
    naming it (exit 2), not a traceback midway (after a batch was stored, or a model loaded)."""
    try:
        return [read() for read in readers]
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_readable(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"input file {path} not found")
    try:
        path.open("rb").close()
    except OSError as e:
        raise os_problem(path, e) from None


def check_writable(path: Path) -> None:
    """Refuses, before any work, a path that cannot be written: a directory, or in one that is missing or
    read-only."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory")
    if not path.parent.is_dir():
        raise UsageError(f"directory {path.parent} not found")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise UsageError(f"{path}: Permission denied")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Self-hosted batch LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(commands)
    add_db_parser(commands)
    add_submit_parser(commands)
    add_status_parser(commands)
    add_results_parser(commands)
    from worker.api_commands import add_api_parser, add_keys_parser
    from worker.serve_command import add_serve_parser
    from worker.worker_command import add_worker_parser  # their own modules: the services' wiring

    add_worker_parser(commands)
    add_api_parser(commands)
    add_keys_parser(commands)
    add_serve_parser(commands)
    return parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that configure the engine; unset ones keep the engine's defaults."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True, metavar="DIR",
                       help="a Hugging Face checkpoint directory, or 'demo' (a tiny random model, built once)")
    group.add_argument("--served-model-name", metavar="NAME",
                       help="the `model` field of responses (default: the directory's name)")
    group.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (default: the checkpoint's)")
    group.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    group.add_argument("--max-num-seqs", type=int, metavar="N", help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="most tokens in one step")
    group.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV cache size in blocks (default: from memory)")
    group.add_argument("--block-size", type=int, metavar="N", help="tokens per KV cache block")
    group.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization, applied on load")
    group.add_argument("--quantization-group-size", type=int, choices=[32, 64, 128], metavar="N",
                       help="int4 group size along the input dimension (default 128)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "int8"], help="int8 holds about twice the tokens")


# the `engine` extra's packages by import name (pyproject.toml): `run`, `worker` and `serve` need them; an API host not
ENGINE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "jinja2", "ninja")


def require_engine() -> None:
    """An API-only install (`pip install sluice`) has no engine: say what to install instead of a traceback."""
    missing = [name for name in ENGINE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"this command runs the engine, which needs {', '.join(missing)}: "
                         "pip install 'sluice[engine]' (on a GPU host 'sluice[gpu]')")


def load_engine(args: argparse.Namespace) -> LLMEngine:
    if args.model != "demo" and not Path(args.model).is_dir():
        raise UsageError(f"model directory {args.model} not found (give a checkpoint directory or 'demo')")
    from worker.engine import LLMEngine

    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    try:
        return LLMEngine(args.model, **kwargs)
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot load model {args.model}: {e}") from None
    except (TypeError, *_config_errors()) as e:  # a config.json value of the wrong type, as transformers reads it
        problem = " ".join(str(e).split())
        raise UsageError(f"--model {args.model}: config.json: {problem}") from None


def _config_errors() -> tuple[type[Exception], ...]:
    try:  # huggingface_hub >= 1.0 validates transformers' configs with its strict dataclasses
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return "demo" if args.model == "demo" else Path(args.model).resolve().name


def add_run_parser(commands) -> None:
    parser = commands.add_parser(
        "run", help="run an OpenAI batch file on a local model",
        description="Run an OpenAI-format batch file (/v1/chat/completions and /v1/completions lines) on a local "
                    "model. Results are appended as they finish; rerunning with the same output file resumes. "
                    "Exit code: 0 when every line succeeded, 1 when any line is in the error file, 2 for usage errors.")
    parser.add_argument("input", type=Path, metavar="INPUT.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl",
                        help="results, appended; custom_ids already there are skipped")
    parser.add_argument("--errors", type=Path, metavar="ERRORS.jsonl",
                        help="invalid lines, rewritten each run (default: OUTPUT's name with .errors.jsonl)")
    add_engine_args(parser)
    parser.set_defaults(handler=run_command)


def default_errors_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")


def run_command(args: argparse.Namespace) -> int:
    require_engine()
    errors = args.errors or default_errors_path(args.output)
    check_readable(args.input)
    for path in (args.output, errors):
        if path.resolve() == args.input.resolve():
            raise UsageError(f"{path} is the input file")
        check_writable(path)  # before the model loads, which takes a while
    if args.output.resolve() == errors.resolve():
        raise UsageError("the output and error files must differ")
    from worker.run import ResumeError, RunIOError, finished_ids, run_batch

    try:
        done = finished_ids(args.output)
    except ResumeError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise os_problem(args.output, e) from None
    engine = load_engine(args)
    resume = f"finished results are in {args.output}, rerun the same command to resume"
    try:
        summary = run_batch(args.input, args.output, errors, engine, served_model_name(args), done)
    except KeyboardInterrupt:
        print(f"\nsluice run: interrupted; {resume}", file=sys.stderr)
        return 130
    except RunIOError as e:
        raise UsageError(f"{e}; {resume}") from None
    print(f"sluice run: {summary.succeeded} succeeded, {summary.failed} failed"
          + (f" (see {errors})" if summary.failed else "")
          + (f", {summary.skipped} already in {args.output}" if summary.skipped else ""), file=sys.stderr)
    return 1 if summary.failed else 0


# The commands below talk to the database (SLUICE_DATABASE_URL, default sqlite:///./.sluice/sluice.db) and the broker
# (SLUICE_BROKER_URL); they import api/ only, never the engine.


def make_db_engine(**kwargs):
    """db.make_engine, with a malformed SLUICE_DATABASE_URL reported in one line."""
    from sqlalchemy.exc import SQLAlchemyError

    from api import db

    try:
        return db.make_engine(**kwargs)
    except (SQLAlchemyError, ValueError, OSError) as e:
        raise UsageError(f"SLUICE_DATABASE_URL {db.database_url()!r}: {e}") from None


@contextmanager
def database() -> Iterator:
    """A transaction on SLUICE_DATABASE_URL; a database that is down or not migrated is reported in one line."""
    from sqlalchemy.exc import SQLAlchemyError

    from api import db

    engine = make_db_engine()
    try:
        with db.session_factory(engine).begin() as session:
            yield session
    except SQLAlchemyError as e:
        problem = str(getattr(e, "orig", None) or e).splitlines()[0]
        message = f"database {engine.url!r}: {problem} (is it up, and migrated with `sluice db upgrade`?)"
        raise UsageError(message) from None
    finally:
        engine.dispose()


def add_db_parser(commands) -> None:
    parser = commands.add_parser("db", help="manage the database of SLUICE_DATABASE_URL")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("upgrade", help="apply the schema migrations (safe to repeat)").set_defaults(
        handler=db_upgrade_command)


def db_upgrade_command(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from api import db

    engine = make_db_engine()
    try:
        db.upgrade(engine)
    except SQLAlchemyError as e:
        raise UsageError(f"cannot migrate {engine.url!r}: {e}") from None
    print(f"sluice db: {engine.url!r} is at the latest schema", file=sys.stderr)
    return 0


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

    from api import queue, store
    from api.settings import Settings

    # the API's limits, so that a file either takes is a batch for both; the chunk size before the batch is stored
    limits, _ = read_settings(Settings.from_env, queue.chunk_size)
    data = read_limited(args.input, limits.max_file_bytes)
    priority = store.DEFAULT_PRIORITY if args.priority is None else args.priority
    try:
        with database() as session:
            batch, work = store.submit_jsonl(session, args.tenant or store.DEFAULT_TENANT, args.input.name, data,
                                             model=args.model, completion_window=args.completion_window,
                                             priority=priority, max_bytes=limits.max_file_bytes,
                                             max_lines=limits.max_batch_lines)
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
    from api import store

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
    from api import store

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


def write_files(files: list[tuple[Path, Iterable[dict]]]) -> list[int]:
    """Writes each JSONL file beside its path and moves them all into place only once every one is complete, so a
    failure midway (disk full, a file size limit) leaves the previous files whole. Returns the line counts."""
    temps = [path.with_name(f".{path.name}.{os.getpid()}.tmp") for path, _ in files]
    try:
        counts = [_write_jsonl(temp, path, records) for temp, (path, records) in zip(temps, files)]
        for temp, (path, _) in zip(temps, files):
            try:
                os.replace(temp, path)
            except OSError as e:
                raise os_problem(path, e) from None
        return counts
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _write_jsonl(temp: Path, path: Path, records: Iterable[dict]) -> int:
    count = 0
    try:
        with temp.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
            f.flush()
            os.fsync(f.fileno())  # complete on disk before it replaces the old file
    except OSError as e:
        raise os_problem(path, e) from None
    return count
