"""The `sluice` command line: argparse subcommands, each one a parser function and a handler function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine import LLMEngine

ENGINE_FLAGS = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size")


class UsageError(Exception):
    """A mistake in the command itself: reported on stderr with exit code 2, without a traceback."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as e:
        print(f"sluice {args.command}: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Self-hosted batch LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(commands)
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


def load_engine(args: argparse.Namespace) -> LLMEngine:
    if args.model != "demo" and not Path(args.model).is_dir():
        raise UsageError(f"model directory {args.model} not found (give a checkpoint directory or 'demo')")
    from worker.engine import LLMEngine

    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    try:
        return LLMEngine(args.model, **kwargs)
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot load model {args.model}: {e}") from None


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


def run_command(args: argparse.Namespace) -> int:
    errors = args.errors or args.output.with_name(args.output.name.removesuffix(".jsonl") + ".errors.jsonl")
    if not args.input.is_file():
        raise UsageError(f"input file {args.input} not found")
    for path in (args.output, errors):
        if not path.parent.is_dir():
            raise UsageError(f"directory {path.parent} not found")
        if path.resolve() == args.input.resolve():
            raise UsageError(f"{path} is the input file")
    if args.output.resolve() == errors.resolve():
        raise UsageError("the output and error files must differ")
    from worker.run import ResumeError, finished_ids, run_batch

    try:
        done = finished_ids(args.output)
    except ResumeError as e:
        raise UsageError(str(e)) from None
    engine = load_engine(args)
    try:
        summary = run_batch(args.input, args.output, errors, engine, served_model_name(args), done)
    except KeyboardInterrupt:
        print(f"\nsluice run: interrupted; finished results are in {args.output}, rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(f"sluice run: {summary.succeeded} succeeded, {summary.failed} failed"
          + (f" (see {errors})" if summary.failed else "")
          + (f", {summary.skipped} already in {args.output}" if summary.skipped else ""), file=sys.stderr)
    return 1 if summary.failed else 0
