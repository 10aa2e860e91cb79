"""The inference engine: continuous batching over a paged KV cache."""

from sluice.worker.engine.llm import LLM, LLMEngine, RequestRejected
from sluice.worker.engine.lora import LoRARequest
from sluice.worker.engine.outputs import RequestOutput
from sluice.worker.engine.processor import InputProcessor
from sluice.worker.engine.sampling_params import SamplingParams

__all__ = ["LLM", "InputProcessor", "LLMEngine", "LoRARequest", "RequestOutput", "RequestRejected", "SamplingParams"]
