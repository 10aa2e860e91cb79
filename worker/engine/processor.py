"""Requests in, before the model: tokenization, the chat template and the limits a request must fit (vLLM V1's
Processor). The engine owns one; a GPU worker's task threads use their own, in the worker process, while the model
lives in the engine's process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sluice.worker.engine.config import EngineConfig, ModelConfig
from sluice.worker.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class RequestRejected(ValueError):
    """A request the engine can never run; others are unaffected. `code` says why, in OpenAI's terms; `param` names
    the SamplingParams field at fault (None: the prompt)."""

    def __init__(self, message: str, code: str = "invalid_prompt", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


@dataclass
class InputProcessor:
    tokenizer: PreTrainedTokenizerBase
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    num_kv_blocks: int

    @classmethod
    def load(cls, path: Path, config: EngineConfig, num_kv_blocks: int) -> InputProcessor:
        model_config = ModelConfig.from_dir(path)
        return cls(load_tokenizer(path), config, model_config, max_model_len(config, model_config), num_kv_blocks)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.token_ids(prompt, special=True) if isinstance(prompt, str) else list(prompt)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """`tools` in OpenAI's shape, as transformers takes them; a template that does not read them ignores them."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        return self.token_ids(text, special=False)

    def token_ids(self, text: str, special: bool) -> list[int]:
        """tokenizer.encode(text)'s ids. A fast tokenizer's Rust core gives the same ids without transformers'
        per-call wrapper, which costs as much again on a short prompt (a worker tokenizes every request); its
        encode_batch_fast (tokenizers >= 0.21) also skips the characters' offsets, which nothing here reads."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=special)
        if hasattr(backend, "encode_batch_fast"):
            return backend.encode_batch_fast([text], add_special_tokens=special)[0].ids
        return backend.encode(text, add_special_tokens=special).ids

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus max_tokens) one request may have here: the model's or the cache's limit."""
        return min(self.max_model_len, self.num_kv_blocks * self.config.block_size)

    def check(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected, naming the limit, if the request could never run."""
        if not token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:  # the sampler's index_put would fail the whole step
            raise RequestRejected(f"logit_bias has token id {outside[0]}, outside the model's vocabulary [0, {vocab})",
                                  "invalid_value", "logit_bias")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, "
                f"more than max_model_len ({self.max_model_len})", "context_length_exceeded")
        blocks = -(-total // self.config.block_size)
        if blocks > self.num_kv_blocks:
            raise RequestRejected(
                f"prompt plus max_tokens ({total} tokens) needs {blocks} KV blocks; the cache has "
                f"{self.num_kv_blocks}", "context_length_exceeded")


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The user's max_model_len, or the model's; more than the model was trained for is refused (as vLLM does)."""
    derived = derived_max_len(model_config)
    if config.max_model_len is None:
        return derived
    if config.max_model_len > derived:
        raise ValueError(f"max_model_len ({config.max_model_len}) is more than the model's context: "
                         f"max_position_embeddings ({model_config.max_position_embeddings}){_scaled(model_config)}")
    return config.max_model_len


def derived_max_len(c: ModelConfig) -> int:
    """vLLM's rule: linear rope scaling extends max_position_embeddings by its factor; a llama3 config's
    max_position_embeddings is already the extended length."""
    scaling = c.rope_scaling
    if scaling is not None and scaling["rope_type"] == "linear":
        return int(c.max_position_embeddings * scaling["factor"])
    return c.max_position_embeddings


def _scaled(c: ModelConfig) -> str:
    if derived_max_len(c) == c.max_position_embeddings:
        return ""
    return f" x linear rope factor {c.rope_scaling['factor']}"
