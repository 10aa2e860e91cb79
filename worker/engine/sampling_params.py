"""Per-request sampling parameters, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.worker.engine.structured_outputs import StructuredOutputsParams

# what torch.Generator.manual_seed takes: a seed outside it failed in add_request, with torch's message, not ours
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # False: the engine builds no text (RequestOutput.text is None) and the caller decodes the tokens where it likes
    # (detokenizer.decode gives the same text): the worker does so on its task threads, off the engine's process
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the grammar the output must match (grammar.py)
    n: int = 1  # choices sampled from one prefill of the prompt (choices.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "top_k must be -1 (disabled) or an integer >= 1"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (all(isinstance(t, int) and t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids >= 0"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})]"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs must be an integer in [0, 20]"),
            (isinstance(self.detokenize, bool), "detokenize must be a boolean"),
            (isinstance(self.n, int) and 1 <= self.n <= 128, "n must be an integer in [1, 128]"),
            (self.detokenize or not self.stop, "stop strings need detokenize=True: they are matched in the text"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
