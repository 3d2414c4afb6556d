"""The splitserve inference engine (autoregressive Llama family, CPU and CUDA)."""

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, EngineStats, KvCapacityError, TokenEvent
from workers.engine.llm import LLM, CompletionOutput
from workers.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "KvCapacityError",
    "SamplingParams", "TokenEvent",
]
