"""`sluice run`: stream an OpenAI batch file through one engine, appending each result as it finishes.

Without LoRA adapters a line's `model` is ignored: every line runs on the one model, whose name the results carry.
With adapters, a line's `model` picks one (or the base model, by its served name or by naming none), and a line
naming any other is an error line.

The output file is append-only and is the run's memory: a rerun skips the custom_ids already in it (after dropping a
last line cut short by a kill). The error file is rewritten by every run, because every line that is not in the
output is validated again.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from sluice.api.batch_lines import BatchRequest, BatchValidator, LineError, line_error, parse_line
from sluice.api.prefix_order import prefix_groups, prefix_key, prefix_order_enabled, prompt_text
from sluice.api.results import error_line, output_line
from sluice.worker.adapters import ServedModels, UnknownModel
from sluice.worker.engine import LLMEngine, RequestOutput
from sluice.worker.fingerprint import Fingerprints, engine_fingerprint
from sluice.worker.structured import grammar_param
from sluice.worker.translate import PromptError, Responses, engine_inputs

QUEUE_DEPTH = 4  # requests held by the engine per max_num_seqs: enough to refill every batch, with bounded memory


class ResumeError(Exception):
    """The output file holds lines that are not output lines; appending to it would hide that."""


class RunIOError(Exception):
    """The input, output or error file could not be read or written mid-run (disk full, a file size limit): one line
    naming the file. The output keeps every result written before it, a cut last line included, which a rerun
    drops."""


@dataclass
class RunSummary:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    output_tokens: int = 0


def finished_ids(path: Path) -> set[str]:
    """custom_ids already in an output file; cuts off a last line left incomplete by a killed run."""
    done: set[str] = set()
    if not path.exists():
        return done
    keep, newline_missing = 0, False
    with path.open("rb+") as f:
        for number, raw in enumerate(f, 1):
            custom_id = _output_custom_id(raw)
            if custom_id is None:
                if raw.endswith(b"\n"):
                    raise ResumeError(f"{path}: line {number} is not an output line; will not resume into this file")
                break
            done.add(custom_id)
            keep += len(raw)
            newline_missing = not raw.endswith(b"\n")
        f.seek(keep)
        f.truncate()
        if newline_missing:
            f.write(b"\n")
    return done


def _output_custom_id(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for raw in f if raw.strip())


class BatchRun:
    """One pass over an input file: validates lines, keeps the engine fed, writes results and errors."""

    def __init__(self, engine: LLMEngine, served: ServedModels, output: IO[str], errors: IO[str], bar: tqdm):
        self.engine, self.served = engine, served
        self.output, self.errors, self.bar = output, errors, bar
        self.pending: dict[str, tuple[BatchRequest, str]] = {}  # with the served name it runs under
        self.summary = RunSummary()
        self.responses = Responses(engine.tokenizer)
        self.fingerprints = Fingerprints(engine_fingerprint(engine), served)

    def run(self, input_path: Path, done: set[str]) -> RunSummary:
        requests = self._requests(input_path, done)
        window = QUEUE_DEPTH * self.engine.config.max_num_seqs
        start = time.perf_counter()
        while True:
            while len(self.pending) < window and (request := next(requests, None)) is not None:
                self._submit(request)
            if not self.engine.has_unfinished_requests():
                return self.summary
            outputs = self.engine.step()
            self.summary.output_tokens += len(outputs)
            for out in outputs:
                if out.finished:
                    self._finish(out)
            rate = self.summary.output_tokens / max(time.perf_counter() - start, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} output tok/s, {self.summary.failed} failed", refresh=False)

    def _requests(self, path: Path, done: set[str]) -> Iterator[BatchRequest]:
        """Valid lines not yet in the output, those whose prompts share a prefix side by side (as the API orders a
        batch; SLUICE_PREFIX_ORDER=0: file order), so that the engine computes each shared prefix once; invalid
        lines become error lines on the way. Ordering holds each line's key and offset, not its body."""
        lines = self._valid_lines(path, done)
        if not prefix_order_enabled():
            yield from (request for request, _ in lines)
            return
        keyed = [(prefix_key(prompt_text(request.body)), offset, request.line) for request, offset in lines]
        with path.open("rb") as f:
            for group in prefix_groups([key for key, _, _ in keyed]):
                for i in group:
                    _, offset, number = keyed[i]
                    f.seek(offset)
                    yield parse_line(f.readline(), number)

    def _valid_lines(self, path: Path, done: set[str]) -> Iterator[tuple[BatchRequest, int]]:
        """Each valid line not yet in the output, with its byte offset."""
        validator = BatchValidator()
        offset = 0
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                result = validator.validate(raw, number)
                if isinstance(result, LineError):
                    self._fail(result)
                elif result.custom_id in done:
                    self.summary.skipped += 1
                    self.bar.update()
                else:
                    yield result, start

    def _submit(self, request: BatchRequest) -> None:
        try:
            name, lora = self.served.resolve(request.body.model if self.served.loras else None)
        except UnknownModel as e:
            self._fail(line_error(request.line, "model_not_found", str(e), request.custom_id, "body.model"))
            return
        try:
            token_ids, params = engine_inputs(self.engine.processor, request.url, request.body)
        except PromptError as e:
            self._fail(line_error(request.line, e.code, str(e), request.custom_id, e.param))
            return
        self.engine.add_request(token_ids, params, request_id=request.custom_id, lora_request=lora)
        self.pending[request.custom_id] = request, name

    def _finish(self, out: RequestOutput) -> None:
        request, name = self.pending.pop(out.request_id)
        if out.error is not None:
            self._fail(line_error(request.line, "invalid_value", out.error, request.custom_id,
                                  grammar_param(request.body)))
            return
        body = self.responses.response(request.url, request.body, out, name, self.fingerprints.of(name))
        _append(self.output, output_line(request.custom_id, body))
        self.summary.succeeded += 1
        self.bar.update()

    def _fail(self, error: LineError) -> None:
        _append(self.errors, error_line(error))
        self.summary.failed += 1
        self.bar.update()


def _append(f: IO[str], record: dict) -> None:
    try:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
    except OSError as e:
        raise RunIOError(f"{f.name}: {e.strerror or e}") from None


def run_batch(input_path: Path, output_path: Path, errors_path: Path, engine: LLMEngine, served: ServedModels,
              done: set[str]) -> RunSummary:
    """Run every line of input_path whose custom_id is not in `done` (see finished_ids)."""
    # on a terminal the bar redraws in place; in a log file each redraw is a new record, so draw rarely
    interval = 0.1 if sys.stderr.isatty() else 30
    try:
        with (output_path.open("a", encoding="utf-8") as output, errors_path.open("w", encoding="utf-8") as errors,
              tqdm(total=count_lines(input_path), unit="req", desc="requests", file=sys.stderr,
                   mininterval=interval) as bar):
            return BatchRun(engine, served, output, errors, bar).run(input_path, done)
    except OSError as e:
        if (failed := _run_io_error(e)) is not None:  # closing the file that failed on the way out fails again
            raise failed from None
        if e.filename is None:  # not opening a file: writes are _append's, anything else is not ours to explain
            raise
        raise RunIOError(f"{e.filename}: {e.strerror or e}") from None


def _run_io_error(e: BaseException | None) -> RunIOError | None:
    while e is not None and not isinstance(e, RunIOError):
        e = e.__context__
    return e
