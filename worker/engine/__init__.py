"""The inference engine: continuous batching over a paged KV cache."""

from worker.engine.llm import LLM, LLMEngine, RequestRejected
from worker.engine.outputs import RequestOutput
from worker.engine.processor import InputProcessor
from worker.engine.sampling_params import SamplingParams

__all__ = ["LLM", "InputProcessor", "LLMEngine", "RequestOutput", "RequestRejected", "SamplingParams"]
