"""Structured outputs in the engine (xgrammar): grammars compiled off the step loop and cached, a matcher per
sequence, and each step's token bitmasks applied to the logits in one batched call."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from sluice.worker.engine.sequence import Sequence, SequenceStatus
from sluice.worker.engine.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_SIZE = 64  # compiled grammars kept: a batch mostly shares one schema, a handful at most
COMPILE_TIMEOUT_SECONDS = 30.0
IDLE_WAIT_SECONDS = 0.05  # how long a step with nothing else to run waits for a grammar to compile
_LOOSE_STRING_CHAR, _JSON_STRING_CHAR = r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]"
_CPP_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[19:30:57] /project/cpp/x.cc:5088: "


@dataclass
class _Compile:
    """One grammar's compilation: its future, and when the pool started it (the timeout excludes queueing)."""

    future: Future
    started: float | None = None


@dataclass
class GrammarStats:
    compiles: int = 0
    compile_seconds: float = 0.0
    mask_steps: int = 0
    mask_seconds: float = 0.0


@dataclass
class _Waiting:
    seq: Sequence
    job: _Compile


@dataclass
class Grammars:
    """Holds a request back until its grammar has compiled, then hands it to the scheduler with its matcher."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # the model's (logits' width), padding included
    stop_token_ids: list[int]
    max_num_seqs: int
    compile_timeout: float = COMPILE_TIMEOUT_SECONDS
    stats: GrammarStats = field(default_factory=GrammarStats)

    def __post_init__(self) -> None:
        # one thread: compiles queue behind each other rather than take CPU from the step loop
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        self._cache: OrderedDict[StructuredOutputsParams, _Compile] = OrderedDict()
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use: a large vocabulary takes a while
        self._bitmask: torch.Tensor | None = None
        self._batch = xgr.BatchGrammarMatcher()

    # --- admission

    def add(self, seq: Sequence) -> None:
        """Start (or reuse) the compilation of seq's grammar; the sequence waits here until `poll` admits it."""
        spec = seq.params.structured_outputs
        job = self._cache.get(spec)
        if job is None:
            job = _Compile(Future())
            job.future = self._pool.submit(self._compile, spec, job)
            self._cache[spec] = job
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)  # waiting sequences keep their own reference to the job
        self._cache.move_to_end(spec)
        self._waiting.append(_Waiting(seq, job))

    def poll(self, idle: bool) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """Sequences whose grammar is ready (with their matcher), and those whose grammar failed, with why.
        `idle`: nothing else can run this step, so wait a little for a compile rather than spin."""
        if idle and self._waiting:
            wait_futures({w.job.future for w in self._waiting}, IDLE_WAIT_SECONDS, "FIRST_COMPLETED")
        ready, failed, still = [], [], []
        now = time.perf_counter()
        for w in self._waiting:
            if w.job.future.done():
                error = w.job.future.exception()
                if error is None:
                    w.seq.grammar = w.job.future.result()
                    w.seq.matcher = xgr.GrammarMatcher(w.seq.grammar)
                    ready.append(w.seq)
                else:
                    failed.append((w.seq, f"the grammar could not be compiled: {_reason(error)}"))
            elif w.job.started is not None and now - w.job.started > self.compile_timeout:
                self._cache.pop(w.seq.params.structured_outputs, None)  # a later request may try again
                failed.append((w.seq, f"the grammar took more than {self.compile_timeout:g} s to compile"))
            else:
                still.append(w)
        self._waiting = still
        return ready, failed

    def discard(self, seq: Sequence) -> bool:
        """Forget a sequence still waiting for its grammar (aborted); False if it is not here."""
        kept = [w for w in self._waiting if w.seq is not seq]
        found = len(kept) < len(self._waiting)
        self._waiting = kept
        if found:
            seq.status = SequenceStatus.FINISHED
        return found

    def clear_cache(self) -> None:
        """Forget compiled grammars (benchmarks: each run pays its compile, as a fresh worker would)."""
        self._cache.clear()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _compile(self, spec: StructuredOutputsParams, job: _Compile) -> xgr.CompiledGrammar:
        job.started = time.perf_counter()
        compiler = self._get_compiler()
        if spec.json is not None or spec.json_object:  # json_object: any object, through the same narrowed rules
            grammar = compiler.compile_grammar(json_schema_ebnf(spec.json or '{"type": "object"}'))
        elif spec.regex is not None:
            grammar = compiler.compile_regex(spec.regex)
        else:  # choice: EBNF string literals take JSON's escapes
            grammar = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - job.started
        return grammar

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # our own cache keys by spec and bounds the count; xgrammar's would hold every grammar again
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    # --- each step

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in place, every token the grammar of a row's sequence does not allow next."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        start = time.perf_counter()
        if self._bitmask is None or self._bitmask.shape[0] < len(seqs):
            self._bitmask = xgr.allocate_token_bitmask(max(self.max_num_seqs, len(seqs)), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([seqs[i].matcher for i in rows], self._bitmask, rows)
        bitmask = self._bitmask[:len(seqs)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        self.stats.mask_steps += 1
        self.stats.mask_seconds += time.perf_counter() - start


def json_schema_ebnf(schema: str) -> str:
    """The schema's grammar, compact (no free whitespace: a weak model cannot loop on it until max_tokens).
    xgrammar 0.2's strings with a minLength or maxLength admit raw control characters, which JSON forbids (its
    unbounded strings do not): those rules are narrowed to JSON's string characters."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _reason(error: BaseException) -> str:
    return _CPP_LOCATION.sub("", str(error)).strip()


def fork_matcher(parent: Sequence) -> xgr.GrammarMatcher:
    """A fresh matcher of the parent's grammar, for a choice of an n > 1 request (the parent never samples)."""
    return xgr.GrammarMatcher(parent.grammar)


def accept(seq: Sequence, token: int) -> bool:
    """Advance seq's matcher by its new token; True once the grammar is complete (the sequence ends with "stop").
    Preemption recomputes the KV of tokens already accepted and never takes one back, so the matcher stays in step.
    """
    if not seq.matcher.accept_token(token):
        # the mask allowed only tokens the matcher accepts: reaching here is a bug, and the output is cut short
        log.error("request %s: the grammar refused token %d that its own mask allowed", seq.request_id, token)
        return True
    return seq.matcher.is_terminated()
