"""Shared benchmark pieces: the 91M-parameter bench Llama and a seeded mixed-length workload."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sluice.worker.engine.demo import build_checkpoint, cache_dir

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
BROKER_URL = "redis://127.0.0.1:6379/15"

BENCH_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=2816, vocab_size=4096, max_position_embeddings=2048)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def bench_model(dtype: str = "float32") -> Path:
    """The bench Llama (hidden 1024, 8 layers, 16/4 heads, vocab 4096), built once under the user cache."""
    path = cache_dir() / f"bench-llama-91m-{dtype}"
    if not (path / "config.json").exists():
        build_checkpoint(path, "LlamaForCausalLM", seed=0, dtype=dtype, **BENCH_SHAPE)
    return path


def small_model() -> Path:
    """A small Llama (hidden 256, 4 layers, ~3M parameters): a step costs more than the demo's, still tiny."""
    path = cache_dir() / "bench-llama-small"
    if not (path / "config.json").exists():
        build_checkpoint(path, "LlamaForCausalLM", seed=0, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    return path


def workload(n: int = 64, seed: int = 0, prompt_range=(10, 200), max_tokens_range=(8, 128)) -> list[Request]:
    rng = random.Random(seed)
    vocab = BENCH_SHAPE["vocab_size"]
    return [Request([rng.randrange(5, vocab) for _ in range(rng.randint(*prompt_range))],
                    rng.randint(*max_tokens_range)) for _ in range(n)]


@contextmanager
def scratch_database() -> Iterator[str]:
    """A migrated database of its own and a flushed Redis db 15 for one run through the service: yields the database
    URL; afterwards the database is dropped (its connections with it) and db 15 flushed again."""
    import redis
    from sqlalchemy import create_engine, text

    from sluice.api import db

    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"sluice_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    redis.Redis.from_url(BROKER_URL).flushdb()
    try:
        migrated = db.make_engine(url)
        db.upgrade(migrated)
        migrated.dispose()
        yield url
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()
        redis.Redis.from_url(BROKER_URL).flushdb()
