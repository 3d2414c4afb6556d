"""The splitserve inference engine (autoregressive Llama family, CPU and CUDA): a driver of
the serving core (`splitserve.core`) over a model runner."""

from splitserve.core import KvCapacityError, SamplingParams, StageKey, StageSpec, TokenEvent
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.llm import LLM, CompletionOutput

__all__ = [
    "LLM", "CompletionOutput", "Engine", "EngineConfig", "KvCapacityError", "SamplingParams", "StageKey",
    "StageSpec", "TokenEvent",
]
