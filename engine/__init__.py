"""specplan's inference engine: paged KV cache, continuous batching, speculative decoding.

What other packages use is exported here; the HTTP server (which needs fastapi) has its own
exports in ``specplan.engine.server``. The engine imports nothing from specplan's planner,
policies, profiler or benches.
"""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from .decider import (FixedDecider, PredictsStepTime, RequestRecord, RequestView, ScreensSteps, SpecDecider,
                      StepOutline, StepRecord, StepView)
from .drafts import DraftTokens, DraftTree
from .engine import LLMEngine, RequestError, RequestOutput
from .llm import LLM
from .metrics import SpecStats
from .model.loader import LoadedModel, ModelLoadError, default_model_path, load_model
from .proposers.base import Proposer
from .proposers.factory import make_proposer
from .proposers.ngram import NgramProposer
from .proposers.suffix import SuffixProposer
from .sampling import SamplingParams, TokenLogprob
from .sequence import Sequence

__all__ = [
    # building and running an engine
    "LLM", "LLMEngine", "SamplingParams", "TokenLogprob", "RequestOutput", "RequestError", "Sequence",
    "EngineConfig", "CacheConfig", "SchedulerConfig", "SpecConfig", "ModelConfig",
    "LoadedModel", "ModelLoadError", "default_model_path", "load_model",
    # the decider seam (a planner implements SpecDecider)
    "SpecDecider", "PredictsStepTime", "ScreensSteps", "FixedDecider", "StepView", "StepOutline", "RequestView",
    "StepRecord", "RequestRecord",
    "SpecStats",
    # proposers and what they answer
    "Proposer", "make_proposer", "NgramProposer", "SuffixProposer", "DraftTokens", "DraftTree",
]
