"""Prefix-aware ordering: 20 documents of about 500 tokens with 10 questions each, shuffled, run in file order
(SLUICE_PREFIX_ORDER=0) and grouped by prompt prefix (the default), through `sluice run` and through the service with
two workers.

Prints for each: the prefix-cache hit rate (cached prompt tokens over prompt tokens; grouped, each document's prefix
is computed about once, 0.9 of its ten lines' document tokens hit), the prompt tokens computed, and the throughput
ratio grouped / file order. `sluice run` runs in this process on the bench Llama; the service part needs PostgreSQL
and Redis (db 15) as the tests do, starts two `sluice worker`s (one engine thread each) and submits one batch.
Run: python bench/prefix_order.py [--docs 20] [--questions 10] [--skip-service]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BROKER_URL, bench_model, scratch_database  # noqa: E402

WORDS = "the of river bank market price report quarter growth north south energy plant water policy city".split()


def batch_lines(docs: int, questions: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(250)) for _ in range(docs)]
    lines = [{"custom_id": f"doc{d}-q{q}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "bench", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "system", "content": "Answer from the document."},
                                    {"role": "user", "content": texts[d]},
                                    {"role": "user", "content": f"Question {q}: what about item {q}?"}]}}
             for d in range(docs) for q in range(questions)]
    rng.shuffle(lines)
    return lines


def through_run(model: Path, lines: list[dict], ordered: bool) -> dict:
    from sluice.worker.adapters import ServedModels
    from sluice.worker.engine import LLM
    from sluice.worker.run import run_batch

    os.environ["SLUICE_PREFIX_ORDER"] = "1" if ordered else "0"
    llm = LLM(str(model), max_num_seqs=64)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_text("".join(json.dumps(x) + "\n" for x in lines))
        start = time.perf_counter()
        run_batch(source, Path(tmp) / "out.jsonl", Path(tmp) / "err.jsonl", llm, ServedModels("bench"), set())
        seconds = time.perf_counter() - start
    stats = llm.stats()
    return {"seconds": seconds, "hit_rate": stats["prefix_cache_hits"] / stats["prefix_cache_queries"],
            "prefill_tokens": stats["num_prefill_tokens"]}


def through_service(model: Path, lines: list[dict], ordered: bool) -> dict:
    with scratch_database() as url:
        return _through_service(url, model, lines, ordered)


def _through_service(url: str, model: Path, lines: list[dict], ordered: bool) -> dict:
    from sluice.api import db, store
    from sluice.api.dispatch import dispatch
    from sluice.api.queue import make_app

    env = {**os.environ, "SLUICE_DATABASE_URL": url, "SLUICE_BROKER_URL": BROKER_URL}
    workers = []
    engine = db.make_engine(url)
    try:
        sessions = db.session_factory(engine)
        workers = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--model", str(model),
                                     "--served-model-name", "bench", "--loglevel", "WARNING", "--max-num-seqs", "32",
                                     "--engine-threads", "1", "--no-cpu-pinning"], env=env) for _ in range(2)]
        while True:  # both workers up: their start-up is not what is measured
            with sessions.begin() as s:
                if len(store.live_workers(s, "bench")) == 2:
                    break
            if any(w.poll() is not None for w in workers):
                raise RuntimeError("a worker exited while starting")
            time.sleep(0.2)
        os.environ["SLUICE_PREFIX_ORDER"] = "1" if ordered else "0"
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        start = time.perf_counter()
        with sessions.begin() as s:
            batch, work = store.submit_jsonl(s, "bench", "in.jsonl", data)
        dispatch(make_app(BROKER_URL), [work], [])
        while True:
            with sessions.begin() as s:
                view = store.batch_view(s, store.get_batch(s, batch.id))
            if view["status"] == "completed":
                break
            time.sleep(0.1)
        seconds = time.perf_counter() - start
        usage = view["usage"]
        return {"seconds": seconds, "hit_rate": usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"],
                "prefill_tokens": usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]}
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=60)
        engine.dispose()


def report(where: str, file_order: dict, grouped: dict) -> None:
    for name, r in (("file order", file_order), ("grouped", grouped)):
        print(f"{where:13s} {name:10s}: hit rate {r['hit_rate']:.3f}, prompt tokens computed {r['prefill_tokens']}, "
              f"{r['seconds']:.2f} s")
    print(f"{where:13s} grouped / file order: throughput {file_order['seconds'] / grouped['seconds']:.2f}x, prompt "
          f"tokens computed {grouped['prefill_tokens'] / file_order['prefill_tokens']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--skip-service", action="store_true", help="only `sluice run` (no PostgreSQL or Redis)")
    args = parser.parse_args()
    model = bench_model()
    lines = batch_lines(args.docs, args.questions)
    report("sluice run", through_run(model, lines, False), through_run(model, lines, True))
    if not args.skip_service:
        report("service (x2)", through_service(model, lines, False), through_service(model, lines, True))


if __name__ == "__main__":
    main()
