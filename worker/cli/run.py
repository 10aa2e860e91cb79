"""`sluice run`: an OpenAI batch file through a local engine, results appended as they finish."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sluice.worker.cli.common import (
    UsageError,
    add_engine_args,
    check_readable,
    check_writable,
    default_errors_path,
    load_engine,
    os_problem,
    require_engine,
    served_models,
)


def add_parsers(commands) -> None:
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
    served = served_models(args)  # a malformed --lora before the model loads
    from sluice.worker.run import ResumeError, RunIOError, finished_ids, run_batch

    try:
        done = finished_ids(args.output)
    except ResumeError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise os_problem(args.output, e) from None
    engine = load_engine(args)
    resume = f"finished results are in {args.output}, rerun the same command to resume"
    try:
        summary = run_batch(args.input, args.output, errors, engine, served, done)
    except KeyboardInterrupt:
        print(f"\nsluice run: interrupted; {resume}", file=sys.stderr)
        return 130
    except RunIOError as e:
        raise UsageError(f"{e}; {resume}") from None
    print(f"sluice run: {summary.succeeded} succeeded, {summary.failed} failed"
          + (f" (see {errors})" if summary.failed else "")
          + (f", {summary.skipped} already in {args.output}" if summary.skipped else ""), file=sys.stderr)
    return 1 if summary.failed else 0

