"""The offline Python API, in the style of vLLM: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq

import torch
from rich.progress import Progress

from .config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from .decider import SpecDecider
from .engine import LLMEngine, RequestOutput
from .model.loader import LoadedModel
from .model_runner import KV_CACHE_DTYPES
from .sampling import SamplingParams


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``model``: a Hugging Face directory, a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
    ``quantize``: none | gguf | int8 | q4 (load_model's; engine/model/quant.py).
    ``kv_cache_dtype``: auto | float32 | float16 (model_runner.kv_cache_dtype: auto is float16 for
    quantised weights on CPU, else the engine's dtype).
    ``speculative_config``: None (no speculation), a SpecConfig, or a dict of its fields, e.g.
    ``{"proposer": "ngram", "k": 4}``. ``decider``: who picks k per request each step (default:
    the fixed k of the config; specplan's planner for adaptive speculation).
    """

    def __init__(self, model: str | None = None, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 block_size: int = 16, kv_cache_bytes: int = 512 * 1024**2, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int = 2048, seed: int = 0,
                 speculative_config: SpecConfig | dict | None = None, decider: SpecDecider | None = None,
                 loaded: LoadedModel | None = None, draft_loaded: LoadedModel | None = None,
                 quantize: str | None = None, kv_cache_dtype: str = "auto"):
        spec = SpecConfig(**speculative_config) if isinstance(speculative_config, dict) else speculative_config
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        config = EngineConfig(
            model=model, dtype=dtype, device=device, quantize=quantize, seed=seed, spec=spec,
            cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_cache_bytes,
                              kv_dtype=KV_CACHE_DTYPES.get(kv_cache_dtype)),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
        )
        self.engine = LLMEngine(config, loaded, decider, draft_loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one RequestOutput per prompt and sample."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = []
        for prompt, p in zip(prompts, params_list):
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        t0 = time.perf_counter()
        results: dict[str, list[RequestOutput]] = {}
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(ids))
            while self.engine.has_unfinished:
                self.engine.step()
                for rid in ids:
                    if rid not in results:
                        done = self.engine.pop_finished(rid)
                        if done is not None:
                            results[rid] = done
                            bar.advance(task)
        elapsed = time.perf_counter() - t0
        outputs = [o for rid in ids for o in results[rid]]
        for o in outputs:
            o.metrics["batch_seconds"] = elapsed
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             progress: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in convs]
        return self.generate(prompts, sampling_params, progress)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
