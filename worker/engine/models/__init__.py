"""Model classes by the architecture name in config.json."""

from sluice.worker.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from sluice.worker.engine.models.llama import LlamaForCausalLM
from sluice.worker.engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from sluice.worker.engine.models.phi3 import Phi3ForCausalLM
from sluice.worker.engine.models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
