"""Helpers the `sluice` commands share: usage errors, argument types, file checks, the database and the engine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.worker.adapters import ServedModels
    from sluice.worker.engine import LLMEngine

ENGINE_FLAGS = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                "quantization", "quantization_group_size", "kv_cache_dtype", "max_loras", "max_lora_rank")


MAX_NAME = 255  # a served name names a queue and a stored column (api.store's limit on model names)


class UsageError(Exception):
    """A mistake in the command itself: reported on stderr with exit code 2, without a traceback."""



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
    group.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                       help="serve a PEFT LoRA adapter directory under NAME: a request whose `model` is NAME runs "
                            "with it (repeatable)")
    group.add_argument("--lora-dir", action="append", default=[], type=Path, metavar="DIR",
                       help="serve every subdirectory of DIR as a LoRA adapter named by the subdirectory (repeatable)")
    group.add_argument("--max-loras", type=int, metavar="N",
                       help="adapters on the device at once: the most distinct adapters one step runs (default 8)")
    group.add_argument("--max-lora-rank", type=int, metavar="N", help="the largest adapter rank accepted (default 64)")


# the `engine` extra's packages by import name (pyproject.toml): `run`, `worker` and `serve` need them; an API host not
ENGINE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "jinja2", "ninja", "xgrammar")


def require_engine() -> None:
    """An API-only install (`pip install sluice`) has no engine: say what to install instead of a traceback."""
    missing = [name for name in ENGINE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"this command runs the engine, which needs {', '.join(missing)}: "
                         "pip install 'sluice[engine]' (on a GPU host 'sluice[gpu]')")


def lora_adapters(args: argparse.Namespace) -> dict[str, str]:
    """--lora and --lora-dir as served name -> adapter directory, in the order given; a malformed flag is a
    UsageError naming it. The adapters themselves are read and checked by load_engine."""
    adapters: dict[str, str] = {}
    base = served_model_name(args)

    def add(name: str, path: str, flag: str) -> None:
        if not name.strip() or len(name) > MAX_NAME or "\x00" in name:
            raise UsageError(f"{flag}: an adapter name has 1 to {MAX_NAME} characters, not all blank, none of them NUL")
        if name in adapters:
            raise UsageError(f"{flag}: adapter name {name!r} is given twice")
        if name == base:
            raise UsageError(f"{flag}: adapter name {name!r} is the base model's served name; requests naming it run "
                             "the base model")
        adapters[name] = path

    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise UsageError(f"--lora {spec!r}: give NAME=PATH")
        add(name, str(Path(path).resolve()), f"--lora {spec}")
    for folder in args.lora_dir:
        if not folder.is_dir():
            raise UsageError(f"--lora-dir {folder}: directory not found")
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            add(sub.name, str(sub.resolve()), f"--lora-dir {folder}")
    return adapters


def served_models(args: argparse.Namespace) -> ServedModels:
    """The base model's served name and the adapters of --lora and --lora-dir (usage errors before anything loads)."""
    from sluice.worker.adapters import ServedModels

    return ServedModels.of(served_model_name(args), lora_adapters(args))


def load_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine of the engine flags, every adapter of --lora and --lora-dir read and checked before any work."""
    if args.model != "demo" and not Path(args.model).is_dir():
        raise UsageError(f"model directory {args.model} not found (give a checkpoint directory or 'demo')")
    from sluice.worker.engine import LLMEngine

    served = served_models(args)
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    try:
        engine = LLMEngine(args.model, enable_lora=bool(served.loras), **kwargs)
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot load model {args.model}: {e}") from None
    except (TypeError, *_config_errors()) as e:  # a config.json value of the wrong type, as transformers reads it
        problem = " ".join(str(e).split())
        raise UsageError(f"--model {args.model}: config.json: {problem}") from None
    for request in served.loras.values():
        try:
            engine.add_lora(request)
        except (ValueError, OSError) as e:  # ModelError names the adapter and the problem
            raise UsageError(f"cannot load LoRA adapter {request.lora_path}: {e}") from None
    return engine


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



def default_errors_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")



# The commands below talk to the database (SLUICE_DATABASE_URL, default sqlite:///./.sluice/sluice.db) and the broker
# (SLUICE_BROKER_URL); they import api/ only, never the engine.


def make_db_engine(**kwargs):
    """db.make_engine, with a malformed SLUICE_DATABASE_URL reported in one line."""
    from sqlalchemy.exc import SQLAlchemyError

    from sluice.api import db

    try:
        return db.make_engine(**kwargs)
    except (SQLAlchemyError, ValueError, OSError) as e:
        raise UsageError(f"SLUICE_DATABASE_URL {db.database_url()!r}: {e}") from None


@contextmanager
def database() -> Iterator:
    """A transaction on SLUICE_DATABASE_URL; a database that is down or not migrated is reported in one line."""
    from sqlalchemy.exc import SQLAlchemyError

    from sluice.api import db

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
