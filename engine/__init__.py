"""specplan's inference engine: paged KV cache, continuous batching, speculative decoding.

The engine imports nothing from specplan's planner, policies or profiler.
"""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .engine import LLMEngine, RequestError, RequestOutput
from .llm import LLM
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestError", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "ModelConfig"]
