"""Model implementations, looked up by the checkpoint's architecture name."""

from workers.engine.models.llama import LlamaFamilyForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
}
