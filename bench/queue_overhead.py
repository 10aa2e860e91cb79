"""What the queue-and-database path costs: 10,000 short requests from many producers through Redis, Postgres and
one `sluice worker`, against the same requests through the engine alone, in one run.

Prints requests/s and output tokens/s of both, the overhead, and the Postgres rows and Redis messages (and
commands) per request. Where the worker would pin a CPU engine, it also runs the engine alone so pinned with a Python
process busy on each other CPU, and prints how its stepping compares with those CPUs idle. Needs the local
PostgreSQL and Redis (creates and drops its own database, uses Redis db 15).
Run: python bench/queue_overhead.py [--requests 10000] [--producers 8] [--batch-lines N]
     [--model demo|small|DIR] [--repeat 2] [--pin-producers] [--engine-nice N] [--concurrency N] [--chunk-size N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import redis
from sqlalchemy import func, select, text

from sluice.api import db, store, tables
from sluice.api.queue import chunk_size, make_app, publish_chunks
from sluice.worker.cpus import pin_threads, split_cpus

# torch and the engine are imported only where used: the spawned producers re-import this module, and a client has
# no torch (its objects in every producer's heap made each garbage collection walk them: +0.1 s per 1250-line batch)

BROKER_URL = "redis://127.0.0.1:6379/15"  # common.py's: common imports torch, which the producers must not
WARM_UP_LINES = 8
# A process on the worker's CPUs building Python objects, as the worker does: on 2 vCPUs that share a physical core
# or its memory system, the engine's steps run slower beside it however little else the service does
NEIGHBOUR = "while True:\n    {i: str(i) for i in range(1000)}"
WINDOW_SECONDS = 0.5  # the worker's efficiency windows: the run's timeline at this resolution
ENGINE_FLAGS = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}


def lines(n: int, max_tokens: int, offset: int) -> list[dict]:
    return [{"custom_id": f"r{offset + i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"Summarise item {offset + i} in a few words."}],
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}} for i in range(n)]


def engine_alone(model: str, requests: list[dict], threads: int) -> tuple[float, int, dict]:
    import torch

    from sluice.worker.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, **ENGINE_FLAGS)
    start = time.perf_counter()
    for line in requests:
        body = line["body"]
        llm.add_request(llm.encode_chat(body["messages"]),
                        SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True))
    tokens = running = 0
    while llm.has_unfinished_requests():
        llm.step(finished_only=True)  # as the worker's engine process steps: no outputs of unfinished requests
        if llm.last_step is not None:
            tokens += llm.last_step.num_generated
            running += llm.last_step.num_seqs
    seconds, steps = time.perf_counter() - start, llm.stats()["num_steps"]
    return seconds, tokens, {"steps": steps, "mean_running": running / steps, "busy": llm.busy_seconds}


def engine_beside_python(model: str, requests: list[dict], threads: int) -> tuple[float, int, dict] | None:
    """The engine alone at the worker's engine's thread count, pinned where the worker pins its engine, with NEIGHBOUR
    busy on each CPU the worker keeps: how fast the service's engine could step if the service's own work cost no
    more than keeping those CPUs busy. None where there is no CPU to split."""
    split = split_cpus(threads)
    if split is None:
        return None
    others, engine_cpus = split
    everything = os.sched_getaffinity(0)
    neighbours = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, [{cpu}])\n" + NEIGHBOUR])
                  for cpu in sorted(others)]
    try:
        pin_threads(engine_cpus)
        time.sleep(0.5)  # the neighbours are running
        return engine_alone(model, requests, threads)
    finally:
        pin_threads(everything)
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()


def worker_steps(sessions, start: float, end: float) -> dict:
    """What the worker's engine did, from the efficiency windows it recorded; `timeline` holds, for each window
    of the measured span [start, end] (wall-clock times), its offset from start, its busy fraction and its mean
    running sequences."""
    with sessions.begin() as s:
        rows = s.query(tables.EfficiencyWindow).order_by(tables.EfficiencyWindow.window_start).all()
    steps = sum(w.steps for w in rows)
    timeline = [(w.window_start - start, w.busy_seconds / (w.window_end - w.window_start), w.mean_running_seqs)
                for w in rows if w.window_end > start and w.window_start < end and w.window_end > w.window_start]
    return {"steps": steps, "mean_running": sum(w.mean_running_seqs * w.steps for w in rows) / max(steps, 1),
            "busy": sum(w.busy_seconds for w in rows), "timeline": timeline}


def pg_writes(engine) -> int:
    with engine.connect() as c:
        return int(c.execute(text("SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) "
                                  "FROM pg_stat_user_tables")).scalar())


def redis_commands(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def _submit(session, part: list[dict]):
    data = "".join(json.dumps(line) + "\n" for line in part).encode()
    return store.submit_jsonl(session, store.DEFAULT_TENANT, "in.jsonl", data, model="bench")


def produce(url: str, part: list[dict], batch_lines: int, go, replies, leave) -> None:
    """One producer process: submits its part as batches of batch_lines, in turn, once `go` is set; replies with
    the batch ids and the messages it published, then idles until `leave` is set (its exit takes a CPU for a
    moment: not inside the measured window)."""
    engine = db.make_engine(url)
    sessions, app = db.session_factory(engine), make_app(BROKER_URL)
    with sessions() as s:  # connected and warm before the clock starts, as a running client is
        _submit(s, part[:WARM_UP_LINES])
        s.rollback()  # nothing stored, nothing published (a few rows in Postgres's write counters)
    with app.producer_or_acquire():
        pass
    replies.put("ready")
    go.wait()
    batch_ids, sent = [], 0
    for i in range(0, len(part), batch_lines):
        with sessions.begin() as s:
            batch, work = _submit(s, part[i:i + batch_lines])
        sent += publish_chunks(app, [work])
        batch_ids.append(batch.id)
    replies.put((batch_ids, sent))
    engine.dispose()
    leave.wait()


def check_alive(worker: subprocess.Popen, procs) -> None:
    """Raise, naming it, if the worker or a producer has died: else the bench would wait out its timeouts."""
    if worker.poll() is not None:
        raise RuntimeError(f"the worker exited with code {worker.returncode}; its log is above")
    for p in procs:
        if p.exitcode is not None:  # producers stay alive until `leave` is set
            raise RuntimeError(f"producer {p.name} exited with code {p.exitcode}; its traceback is above")


def collect(replies, worker: subprocess.Popen, procs, timeout: float) -> list:
    """One reply from each producer, checking every half second that nobody died."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(replies.get(timeout=0.5))
        except queue.Empty:
            check_alive(worker, procs)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs) - len(got)} of {len(procs)} producers did not reply in {timeout:.0f} s"
                                   ) from None
    return got


def engine_pid(worker_pid: int) -> int | None:
    """The worker's engine process (its child started by spawn), None if it is not found."""
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                return int(child)
    return None


def through_the_queue(url: str, model: str, requests: list[dict], producers: int, batch_lines: int,
                      pin_producers: bool, nice: int | None, concurrency: int | None) -> dict:
    import cpu_use  # beside this file: main() put its folder on the path

    env = {**os.environ, "SLUICE_DATABASE_URL": url, "SLUICE_BROKER_URL": BROKER_URL}
    worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--model", model, "--served-model-name",
                               "bench", "--loglevel", "WARNING", "--max-num-seqs", str(ENGINE_FLAGS["max_num_seqs"]),
                               "--max-num-batched-tokens", str(ENGINE_FLAGS["max_num_batched_tokens"]),
                               "--window-seconds", str(WINDOW_SECONDS),
                               *(["--engine-nice", str(nice)] if nice is not None else []),
                               *(["--concurrency", str(concurrency)] if concurrency else [])], env=env)
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    client = redis.Redis.from_url(BROKER_URL)
    everything = os.sched_getaffinity(0)  # restored at the end, however the run ends
    try:
        while True:  # wait for the worker: its start-up is not what is measured
            with sessions.begin() as s:
                if store.live_workers(s, "bench"):
                    break
            check_alive(worker, [])
            time.sleep(0.2)
        time.sleep(1.0)
        engine_process = engine_pid(worker.pid)
        ran_at = None if engine_process is None else os.getpriority(os.PRIO_PROCESS, engine_process)
        # --pin-producers: the producers (spawned below, they inherit this process's CPUs) get the worker's CPUs,
        # which a CPU engine's pinning left off the engine's
        if pin_producers and (kept := os.sched_getaffinity(worker.pid)) < everything:
            pin_threads(kept)
        # The producers are processes, as clients are: threads of this one would queue for its GIL behind each
        # other's validation, and a batch's 40 publishes then took 1.6 s instead of milliseconds.
        with sessions.begin() as s:  # the tenant exists, as a client's does: else each producer's first insert of
            store.get_or_create_tenant(s, store.DEFAULT_TENANT)  # it waits for the first producer to commit
        ctx = multiprocessing.get_context("spawn")
        go, leave, replies = ctx.Event(), ctx.Event(), ctx.Queue()
        share = -(-len(requests) // producers)
        procs = [ctx.Process(target=produce, args=(url, requests[i:i + share], batch_lines, go, replies, leave),
                             daemon=True) for i in range(0, len(requests), share)]
        for p in procs:
            p.start()
        collect(replies, worker, procs, 300)  # connected and waiting: their start-up is not what is measured
        writes, commands = pg_writes(engine), redis_commands(client)
        cpu_before = cpu_use.snapshot()
        start, wall_start = time.perf_counter(), time.time()
        go.set()
        sent = collect(replies, worker, procs, 600)
        batch_ids, messages = [b for ids, _ in sent for b in ids], sum(n for _, n in sent)
        submitted = time.perf_counter() - start
        completed = select(func.count()).where(tables.Batch.id.in_(batch_ids), tables.Batch.status == "completed")
        while True:  # a cheap poll, one query: the bench must not steal the CPU it measures
            with sessions.begin() as s:
                if s.scalar(completed) == len(batch_ids):
                    break
            check_alive(worker, [])
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        cpu = cpu_use.split(cpu_before, cpu_use.snapshot(), {
            "worker": {worker.pid}, "engine": {engine_process}, "producers": {p.pid for p in procs},
            "bench": {os.getpid()}})
        leave.set()
        for p in procs:
            p.join()
        with sessions.begin() as s:
            views = [store.batch_view(s, store.get_batch(s, b)) for b in batch_ids]
        commands = redis_commands(client) - commands
        # its last efficiency window is written as it stops; its database connections then close, and with them
        # their server processes flush their pg_stat counters (an idle one flushes only after 10 s): rows written
        # include those few of the stop (its last window and heartbeat)
        worker.terminate()
        worker.wait(timeout=60)
        time.sleep(0.5)
        written = pg_writes(engine) - writes
        steps = worker_steps(sessions, wall_start, wall_start + seconds)
        return {"seconds": seconds, "submitted": submitted, "engine": steps, "nice": ran_at,
                "cpu": cpu, "pg_writes": written, "tokens": sum(v["usage"]["output_tokens"] for v in views),
                "messages": messages, "redis_commands": commands}
    finally:
        pin_threads(everything)
        worker.terminate()
        worker.wait(timeout=60)
        engine.dispose()


def engine_line(name: str, e: dict) -> str:
    return (f"{name}: {e['steps']} steps, {e['mean_running']:.0f} sequences per step on average, "
            f"{e['busy']:.1f} s stepping")


def service(model: str, requests: list[dict], producers: int, batch_lines: int, pin_producers: bool,
            nice: int | None, concurrency: int | None) -> dict:
    """One run through the service, on a database of its own (created, migrated, dropped) and a flushed Redis db."""
    from common import scratch_database

    with scratch_database() as url:
        return through_the_queue(url, model, requests, producers, batch_lines, pin_producers, nice, concurrency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--batch-lines", type=int, default=0,
                    help="lines per batch: each producer submits its share as batches of this size, one after another "
                         "(a batch's work starts once it is stored); default: one batch per producer")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pin-producers", action="store_true",
                    help="run the producers on the worker's CPUs only, off a CPU engine's. By default they may use "
                         "every CPU: they stand in for clients on other machines, and pinned to the worker's one CPU "
                         "on 2 cores all their submitting (8 x 0.25 s) comes before the first batch commits, while "
                         "the engine's CPU idles with nothing to step")
    ap.add_argument("--engine-nice", type=int, metavar="N",
                    help="the worker's --engine-nice (default: the worker's own default, -10 for its pinned CPU engine "
                         "where permitted; 0 gives the engine no priority over the other processes on its CPU)")
    ap.add_argument("--concurrency", type=int, metavar="N", help="the worker's --concurrency (chunks run at once)")
    ap.add_argument("--chunk-size", type=int, metavar="N",
                    help="SLUICE_CHUNK_SIZE for the producers and the worker: requests per message (default 32, or "
                         "what the environment says); each chunk costs a fixed two transactions and a message")
    ap.add_argument("--model", default="demo", help="a checkpoint dir, 'demo', or 'small' (hidden 256, 4 layers)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs of each path, interleaved; the fastest of each counts (this machine's speed drifts)")
    args = ap.parse_args()
    if args.chunk_size is not None:  # the worker and the spawned producers inherit it
        os.environ["SLUICE_CHUNK_SIZE"] = str(args.chunk_size)
    from sluice.worker.bridge import default_engine_threads

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's own modules
    if args.model == "small":
        from common import small_model

        args.model = str(small_model())
    requests = lines(args.requests, args.max_tokens, 0)
    args.batch_lines = args.batch_lines or -(-args.requests // args.producers)
    # The baseline is the engine at its best: with every CPU, and with the worker's engine's thread count (on a
    # small CPU model fewer threads can be as fast, OpenMP's fork-join costing what the extra core brings).
    engine_threads = default_engine_threads()
    counts = sorted({len(os.sched_getaffinity(0)), engine_threads}, reverse=True)
    alones, services, besides = {t: [] for t in counts}, [], []
    for _ in range(args.repeat):
        for t in counts:
            alones[t].append(engine_alone(args.model, requests, t))
        besides.append(engine_beside_python(args.model, requests, engine_threads))
        services.append(service(args.model, requests, args.producers, args.batch_lines, args.pin_producers,
                                args.engine_nice, args.concurrency))
    best = {t: min(runs, key=lambda a: a[0]) for t, runs in alones.items()}
    alone_s, alone_tokens, alone = min(best.values(), key=lambda a: a[0])
    q = min(services, key=lambda r: r["seconds"])
    n = len(requests)
    where = "on the worker's CPUs" if args.pin_producers else "on any CPU"
    print(f"{n} chat requests, {args.max_tokens} output tokens each, model {args.model}, {args.producers} producers "
          f"({where}) submitting batches of {args.batch_lines} lines, "
          f"chunks of {chunk_size()} requests, one worker (max_num_seqs {ENGINE_FLAGS['max_num_seqs']}); "
          f"fastest of {args.repeat} runs each")
    print(f"{'path':42s} {'seconds':>8s} {'req/s':>8s} {'tok/s':>9s}  all runs (s)")
    for t in counts:
        a_s, a_tokens, _ = best[t]
        print(f"{f'engine alone, {t} thread(s)':42s} {a_s:8.1f} {n / a_s:8.1f} {a_tokens / a_s:9.0f}  "
              + " ".join(f"{a[0]:.1f}" for a in alones[t]))
    beside_best = None if besides[0] is None else min(besides, key=lambda b: b[0])
    if beside_best is not None:
        b_s, b_tokens, _ = beside_best
        print(f"{f'engine alone, {engine_threads} thread(s), beside Python':42s} {b_s:8.1f} {n / b_s:8.1f} "
              f"{b_tokens / b_s:9.0f}  " + " ".join(f"{b[0]:.1f}" for b in besides))
    print(f"{'producers -> Redis -> worker -> PG':42s} {q['seconds']:8.1f} {n / q['seconds']:8.1f} "
          f"{q['tokens'] / q['seconds']:9.0f}  " + " ".join(f"{r['seconds']:.1f}" for r in services))
    print(engine_line("engine alone", alone))
    print(engine_line("the worker's engine", q["engine"]) + f", at nice {q['nice']}")
    print(f"the producers had stored and published everything after {q['submitted']:.1f} s")
    print(f"the worker's engine by {WINDOW_SECONDS} s window from the producers' start (busy %, mean running "
          "sequences): " + ", ".join(f"{max(at, 0):.1f} s {busy:.0%} {running:.0f}"
                                     for at, busy, running in q["engine"]["timeline"]))
    cores = len(os.sched_getaffinity(0))
    print(f"CPU-seconds in that run ({q['seconds']:.1f} s on {cores} CPUs, "
          f"{sum(q['cpu'].values()) / (q['seconds'] * cores):.0%} busy): "
          + ", ".join(f"{name} {v:.2f}" for name, v in q["cpu"].items())
          + f"; the worker process {q['cpu']['worker'] / n * 1e6:.0f} us per request")
    # what the service costs beside its engine, whatever the engine runs on (on a GPU host, these CPUs' load)
    beside = sum(q["cpu"][k] for k in ("worker", "producers", "Postgres", "Redis")) / n
    print(f"the service beside its engine (worker process, producers, Postgres, Redis): {beside * 1e6:.0f} us of CPU "
          f"per request, so one CPU carries about {1 / beside:.0f} requests/s of it")
    print(f"queue-and-database overhead: {1 - alone_s / q['seconds']:.1%} of the engine's throughput "
          "(against its fastest run alone)")
    if beside_best is not None:  # stepping only: the engine alone tokenizes on its own CPU, the service on the other
        beside, idle = beside_best[2]["busy"], best[engine_threads][2]["busy"]
        print(f"the engine alone on the worker's engine CPUs stepped {beside:.1f} s with Python busy on the other "
              f"CPUs, against {idle:.1f} s unpinned with them idle ({beside / idle - 1:+.0%}): what the neighbours' "
              "work costs the engine on this machine, however little the service itself spent")
    if args.repeat > 1:  # each round ran its paths back to back: the same spell of this machine's drifting speed
        rounds = [1 - min(alones[t][i][0] for t in counts) / r["seconds"] for i, r in enumerate(services)]
        print("overhead round by round (the service against the fastest engine alone of the same round): "
              + " ".join(f"{o:.1%}" for o in rounds))
    print(f"per request: {q['pg_writes'] / n:.2f} Postgres rows written (inserts+updates), "
          f"{q['messages'] / n:.3f} Redis messages ({q['messages']} chunks), "
          f"{q['redis_commands'] / n:.2f} Redis commands")


if __name__ == "__main__":
    main()
