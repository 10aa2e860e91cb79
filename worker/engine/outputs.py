"""What the engine hands back for a request: tokens, text, finish reason, cache hits and timings."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from sluice.worker.engine.sequence import Sequence, TokenLogprobs

if TYPE_CHECKING:
    from sluice.worker.engine.choices import Choices


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    gpu_seconds: float
    num_preemptions: int

    def __reduce__(self):  # see RequestOutput.__reduce__
        return RequestMetrics, _metrics_fields(self)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None where SamplingParams.detokenize was False
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    # n > 1: every choice's output, in index order; the fields above are then choice 0's, and num_cached_tokens
    # and metrics the request's (the prompt once, step time and preemptions summed)
    choices: list[RequestOutput] | None = None

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated, over every choice."""
        return sum(len(c.token_ids) for c in self.choices) if self.choices else len(self.token_ids)

    def __reduce__(self):
        # pickled once per finished request in the engine's process, unpickled in the worker: as the constructor's
        # arguments, not through slots dataclasses' own __getstate__/__setstate__, which look the fields up on every
        # call (bench/NOTES.md has the timings)
        return RequestOutput, _output_fields(self)

    @classmethod
    def from_seq(cls, seq: Sequence) -> RequestOutput:
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                   seq.finish_time, seq.gpu_seconds, seq.num_preemptions),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    @classmethod
    def from_choices(cls, group: Choices) -> RequestOutput:
        outs = [cls.from_seq(seq) for seq in group.choices]
        ms = [o.metrics for o in outs]
        first_tokens = [m.first_token_time for m in ms if m.first_token_time is not None]
        metrics = RequestMetrics(group.arrival_time, ms[0].first_scheduled_time, min(first_tokens, default=None),
                                 max(m.finish_time for m in ms) if group.is_finished else None,
                                 group.gpu_seconds + sum(m.gpu_seconds for m in ms),
                                 group.num_preemptions + sum(m.num_preemptions for m in ms))
        first = outs[0]
        return cls(group.request_id, group.prompt, group.prompt_token_ids, first.token_ids, first.text,
                   group.is_finished, first.finish_reason, group.num_cached_tokens, metrics, first.logprobs,
                   choices=outs)

    @classmethod
    def rejected(cls, request_id: str, prompt, prompt_token_ids: list[int], error: str, now: float):
        return cls(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, [], "", True, None,
                   0, RequestMetrics(now, None, None, now, 0.0, 0), error=error)


_metrics_fields = attrgetter(*RequestMetrics.__slots__)
_output_fields = attrgetter(*RequestOutput.__slots__)
