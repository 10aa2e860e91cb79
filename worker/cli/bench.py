"""`sluice bench sweep`: one workload at each max_num_seqs cap in one engine; a table, sweep.json and sweep.png."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sluice.worker.cli.common import (
    UsageError,
    add_engine_args,
    check_readable,
    load_engine,
    require_engine,
    served_models,
)

DEFAULT_CAPS = "1,4,16,32,64,128,256"


def add_parsers(commands) -> None:
    bench = commands.add_parser("bench", help="measure the engine on a workload",
                                description="Measure the engine on a workload.")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    # "resolve": this --max-num-seqs (a list of caps) replaces the engine flags' single one
    parser = sub.add_parser(
        "sweep", conflict_handler="resolve", help="throughput and latency at each max_num_seqs",
        description="Run one workload at each max_num_seqs cap, in one process on one loaded model (each cap on a "
                    "cold prefix cache, every request queued at once). Prints a table (output tokens/s, requests/s, "
                    "time to first token and latency p50/p95, mean KV cache use, preemptions), marks the knee (the "
                    "smallest cap within 5% of the best throughput) and writes sweep.json and sweep.png to "
                    "--output-dir.")
    add_engine_args(parser)
    parser.add_argument("--max-num-seqs", type=caps_arg, default=caps_arg(DEFAULT_CAPS), metavar="N,N,...",
                        help=f"the caps to run, comma-separated (default {DEFAULT_CAPS})")
    parser.add_argument("--output-dir", type=Path, required=True, metavar="DIR",
                        help="where sweep.json and sweep.png go (created if missing)")
    workload = parser.add_argument_group("workload: --input, or --num-requests with --prompt-tokens and "
                                         "--output-tokens")
    workload.add_argument("--input", type=Path, metavar="JSONL", help="an OpenAI batch file, run as `sluice run` would")
    workload.add_argument("--num-requests", type=int, metavar="N", help="random prompts of random token ids")
    workload.add_argument("--prompt-tokens", type=range_arg, metavar="A-B", help="prompt lengths, uniform in A..B")
    workload.add_argument("--output-tokens", type=range_arg, metavar="C-D",
                          help="output lengths, uniform in C..D (eos ignored)")
    workload.add_argument("--seed", type=int, default=0, help="of the random workload (default 0)")
    parser.set_defaults(handler=sweep_command)


def caps_arg(text: str) -> list[int]:
    try:
        caps = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give caps as comma-separated integers, e.g. 1,4,16") from None
    if caps[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every cap must be >= 1")
    return caps


def range_arg(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or A-B, e.g. 128-512") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= A <= B")
    return bounds


def sweep_command(args: argparse.Namespace) -> int:
    require_engine()
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("sweep.png is drawn with matplotlib: pip install 'sluice[bench]'")
    check_sweep_args(args)
    served = served_models(args)
    try:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output-dir {args.output_dir}: {e.strerror or e}") from None
    from sluice.worker.sweep import run_sweep
    from sluice.worker.sweep_report import plot, table, write_json

    # the KV cache is sized (on CPU) for the largest cap, then each cap runs on it
    engine = load_engine(argparse.Namespace(**{**vars(args), "max_num_seqs": max(args.max_num_seqs)}))
    workload = read_workload(args, engine, served)
    with progress_bar(len(workload) * len(args.max_num_seqs)) as progress:
        rows = run_sweep(engine, workload, args.max_num_seqs, progress)
    print(table(rows))
    write_json(args.output_dir / "sweep.json", rows, about(args, engine, workload))
    plot(args.output_dir / "sweep.png", rows)
    knee = next(row.max_num_seqs for row in rows if row.knee)
    print(f"sluice bench sweep: knee at max_num_seqs {knee}; wrote sweep.json and sweep.png to {args.output_dir}",
          file=sys.stderr)
    return 0


def check_sweep_args(args: argparse.Namespace) -> None:
    synthetic = (args.num_requests, args.prompt_tokens, args.output_tokens)
    if args.input is not None:
        if any(a is not None for a in synthetic):
            raise UsageError("give --input or --num-requests, --prompt-tokens and --output-tokens, not both")
        check_readable(args.input)
    elif any(a is None for a in synthetic):
        raise UsageError("give --input JSONL, or --num-requests N with --prompt-tokens A-B and --output-tokens C-D")
    elif args.num_requests < 1:
        raise UsageError("--num-requests must be >= 1")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise UsageError(f"--output-dir {args.output_dir} is not a directory")


def read_workload(args: argparse.Namespace, engine, served):
    from sluice.worker.sweep import file_workload, synthetic_workload

    if args.input is not None:
        workload = file_workload(args.input, engine, served)
        if not workload.prompts:
            raise UsageError(f"{args.input}: no line would run ({workload.skipped} invalid or too long; "
                             f"`sluice run` reports why)")
        if workload.skipped:
            print(f"sluice bench sweep: {workload.skipped} lines of {args.input} would not run; left out",
                  file=sys.stderr)
        return workload
    longest = args.prompt_tokens[1] + args.output_tokens[1]
    if longest > engine.max_request_tokens:
        raise UsageError(f"--prompt-tokens plus --output-tokens reach {longest} tokens; this engine runs at most "
                         f"{engine.max_request_tokens} per request (max_model_len, or the KV cache)")
    return synthetic_workload(args.num_requests, args.prompt_tokens, args.output_tokens,
                              engine.model_config.vocab_size, args.seed)


def about(args: argparse.Namespace, engine, workload) -> dict:
    """What the figures were measured on."""
    stats = engine.stats()
    return {"model": args.model, "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "quantization": stats["quantization"], "kv_cache_dtype": stats["kv_cache_dtype"],
            "kv_cache_tokens": stats["kv_cache_tokens"], "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "workload": {"input": str(args.input) if args.input else None, "num_requests": len(workload),
                         "skipped_lines": workload.skipped, "prompt_tokens": args.prompt_tokens,
                         "output_tokens": args.output_tokens, "seed": None if args.input else args.seed}}


@contextmanager
def progress_bar(total: int) -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar on stderr over every request of every cap; the callable counts n more done at a cap."""
    from tqdm import tqdm

    # on a terminal the bar redraws in place; in a log file each redraw is a new record, so draw rarely
    with tqdm(total=total, unit="req", file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 30) as bar:
        def progress(cap: int, n: int) -> None:
            bar.set_description(f"max_num_seqs {cap}", refresh=False)
            bar.update(n)

        yield progress
