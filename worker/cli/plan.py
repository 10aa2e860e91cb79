"""`sluice plan`: what a model needs in a GPU's memory and how many sequences fit, from config.json alone."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from sluice.worker.cli.common import UsageError, check_readable, require_engine


def add_parsers(commands) -> None:
    parser = commands.add_parser(
        "plan", help="plan a model's GPU memory and batch size from config.json",
        description="From config.json alone (no weights are read): the weight bytes, the KV bytes per token, the KV "
                    "tokens that fit in the GPU memory after the weights and the activation headroom (the engine's "
                    "own rules on CUDA), the sequences that fit at the workload's mean and p95 lengths (prompt plus "
                    "max_tokens), and a max_num_seqs to start from. Exit code 1 when the model does not fit.")
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face checkpoint directory")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory the engine may use: bytes or a size such as 80GiB or 24GB (default: what is "
                             "free on this machine's GPU)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the model dtype (default: the checkpoint's)")
    parser.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization, applied on load")
    parser.add_argument("--quantization-group-size", type=int, choices=[32, 64, 128], metavar="N",
                        help="int4 group size along the input dimension (default 128)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], help="int8 holds about twice the tokens")
    parser.add_argument("--max-model-len", type=int, metavar="N", help="the longest sequence (default: the model's)")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                        help="most tokens in one step, which sets the activation headroom (default 4096)")
    parser.add_argument("--block-size", type=int, metavar="N", help="tokens per KV cache block (default 16)")
    workload = parser.add_argument_group("workload (default: every sequence at max_model_len)")
    workload.add_argument("--input", type=Path, metavar="JSONL",
                          help="an OpenAI batch file: lengths from its prompts, tokenized, and max_tokens")
    workload.add_argument("--prompt-tokens", type=int, metavar="N", help="prompt tokens of every request")
    workload.add_argument("--output-tokens", type=int, metavar="N", help="output tokens of every request")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=plan_command)


ENGINE_FIELDS = ("dtype", "quantization", "quantization_group_size", "kv_cache_dtype", "max_model_len",
                 "max_num_batched_tokens", "block_size")


def plan_command(args: argparse.Namespace) -> int:
    require_engine()
    from sluice.worker.engine.config import EngineConfig, ModelConfig
    from sluice.worker.engine.llm import resolve_model
    from sluice.worker.engine.processor import max_model_len
    from sluice.worker.plan import make_plan

    check_workload_args(args)
    path = resolve_model(args.model)
    try:
        config = EngineConfig(model=args.model, **{k: getattr(args, k) for k in ENGINE_FIELDS
                                                   if getattr(args, k) is not None})
        model_config = ModelConfig.from_dir(path)
        max_len = max_model_len(config, model_config)
        gpu_memory = memory_arg(args.gpu_memory)
        workload = read_workload(args, path, config, model_config, max_len)
        plan = make_plan(args.model, model_config, config, max_len, gpu_memory, workload)
    except (ValueError, OSError) as e:  # ModelError, a refused flag, an int4 group that does not divide, no tokenizer
        raise UsageError(str(e)) from None
    print(json.dumps(asdict(plan)) if args.json else describe(plan))
    return 0 if plan.fits else 1


def check_workload_args(args: argparse.Namespace) -> None:
    given = [args.prompt_tokens is not None, args.output_tokens is not None]
    if args.input is not None and any(given):
        raise UsageError("give --input or --prompt-tokens and --output-tokens, not both")
    if any(given) and not all(given):
        raise UsageError("--prompt-tokens and --output-tokens go together")
    if all(given) and (args.prompt_tokens < 1 or args.output_tokens < 1):
        raise UsageError("--prompt-tokens and --output-tokens must be >= 1")
    if args.input is not None:
        check_readable(args.input)
    if args.model != "demo" and not Path(args.model).is_dir():
        raise UsageError(f"model directory {args.model} not found")


def memory_arg(text: str | None) -> int:
    from sluice.worker.plan import parse_size

    if text is not None:
        try:
            size = parse_size(text)
        except ValueError as e:
            raise UsageError(f"--gpu-memory: {e}") from None
        if size < 1:
            raise UsageError("--gpu-memory must be more than 0 bytes")
        return size
    import torch

    if not torch.cuda.is_available():
        raise UsageError("no CUDA device here: give --gpu-memory SIZE (e.g. 80GiB)")
    return torch.cuda.mem_get_info()[0]


def read_workload(args: argparse.Namespace, path: Path, config, model_config, max_len: int):
    from sluice.worker.plan import WorkloadLengths

    if args.input is not None:
        from sluice.worker.batch_lengths import batch_lengths

        lengths, skipped = batch_lengths(args.input, path, config, model_config, max_len)
        if not lengths:
            raise UsageError(f"{args.input}: no line would run ({skipped} invalid or longer than max_model_len)")
        return WorkloadLengths(lengths, str(args.input), skipped)
    if args.prompt_tokens is not None:
        total = args.prompt_tokens + args.output_tokens
        if total > max_len:
            raise UsageError(f"--prompt-tokens plus --output-tokens is {total}, more than max_model_len ({max_len})")
        return WorkloadLengths([total], "given")
    return WorkloadLengths([max_len], "max_model_len")


def describe(plan) -> str:
    gib = 1 << 30
    quant = f", {plan.quantization} weights" if plan.quantization else ""
    kv = "int8" if plan.kv_cache_dtype == "int8" else plan.dtype
    lines = [
        f"model        {plan.model} ({plan.architecture}), {plan.dtype}{quant}, {kv} KV cache",
        f"GPU memory   {plan.gpu_memory_bytes / gib:.2f} GiB",
        f"weights      {plan.weight_bytes / gib:.2f} GiB",
        f"activations  {plan.activation_bytes / gib:.2f} GiB ({plan.max_num_batched_tokens} batched tokens)",
        f"KV per token {plan.kv_cache_bytes_per_token:,} bytes",
        f"workload     {workload_line(plan)}",
    ]
    if not plan.fits:
        return "\n".join([*lines, f"does not fit: {plan.message}"])
    return "\n".join([
        *lines,
        f"KV cache     {plan.kv_cache_bytes / gib:.2f} GiB: {plan.kv_cache_tokens:,} tokens",
        f"sequences    {plan.max_concurrent_sequences:,} at the mean length, {plan.max_concurrent_sequences_p95:,} "
        f"at p95",
        f"recommended  --max-num-seqs {plan.recommended_max_num_seqs} (`sluice bench sweep` measures the knee)",
    ])


def workload_line(plan) -> str:
    if plan.workload == "max_model_len":
        return f"none given: every sequence at max_model_len ({plan.max_model_len:,} tokens)"
    if plan.workload == "given":
        return f"every sequence {plan.sequence_tokens_p95:,} tokens (prompt plus output)"
    skipped = plan.skipped_lines
    left_out = f"; {skipped} lines left out (invalid or longer than max_model_len)" if skipped else ""
    return (f"{plan.num_sequences:,} sequences in {plan.workload}, mean {plan.sequence_tokens_mean:,.0f} tokens, "
            f"p95 {plan.sequence_tokens_p95:,} (prompt plus max_tokens){left_out}")
