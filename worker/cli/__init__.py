"""The `sluice` command line: one module per command group, each with an add_*_parser and its handlers."""

from __future__ import annotations

import argparse
import os
import sys

from sluice.worker.cli import api, batches, bench, db, keys, plan, run, serve, worker
from sluice.worker.cli.common import UsageError


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



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Self-hosted batch LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (run, plan, bench, db, batches, worker, api, keys, serve):
        group.add_parsers(commands)
    return parser
