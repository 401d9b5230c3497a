"""Configuration inside the engine: frozen dataclasses (pydantic lives at the edges: CLI, server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Architectures whose Hugging Face `config.architectures[0]` we run with our own model code.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but its architecture is not one the engine implements."""


@dataclass(frozen=True)
class ModelConfig:
    """The facts about a model that the engine's own implementation needs."""

    architecture: str  # "llama" (also SmolLM2, Mistral-style) or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v projections
    # RoPE: inverse frequencies [head_dim // 2] and a scale applied to cos/sin (YaRN etc.);
    # computed from the model's scaling config with transformers' own rope functions.
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float = 1.0
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # The projections' block formats when quantized ("q4_1+q8_0": engine/model/quant.py), else None.
    quantization: str | None = None

    @staticmethod
    def from_hf(hf_config: Any, name: str = "model") -> "ModelConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = archs[0] if archs else f"{getattr(hf_config, 'model_type', '?')} (no architectures field)"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; specplan runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported activation {act!r} (only silu)")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("unsupported: biases on the MLP projections (mlp_bias=true)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attn_scaling = _rope_parameters(hf_config)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        sliding = getattr(hf_config, "sliding_window", None)
        if family == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        return ModelConfig(
            architecture=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            rope_inv_freq=tuple(float(f) for f in inv_freq),
            rope_attention_scaling=float(attn_scaling),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
            name=name,
        )


def _rope_parameters(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the model's RoPE scaling type, exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        # Dynamic NTK rescales with the running sequence length; we use its static form, which is
        # exact up to the trained context length.
        rope_type = "default"
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"unsupported RoPE scaling type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 512 * 1024**2  # total KV budget (keys and values, all layers)
    # The cache's element type: the engine's dtype, or float16 (half the bytes a decode step's
    # attention reads, and twice the tokens in the same budget). None: auto
    # (model_runner.kv_cache_dtype: float16 for quantised weights on CPU, as llama.cpp's default).
    kv_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 512  # query tokens in one step (prefill chunks + decodes)
    max_model_len: int = 2048  # prompt + output, per request


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded default
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # none | gguf (a GGUF's Q8_0/Q4_0/Q4_1 as stored) | int8 | q4 (quantised at load): load_model
    quantize: str | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: "SpecConfig | None" = None  # None: no speculation


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which proposer, and the most drafts per request per step."""

    proposer: str = "ngram"  # ngram | suffix | layer-skip | draft | eagle | chain
    k: int = 4  # drafts per request for the fixed-k decider (a planner decides otherwise)
    max_k: int = 8  # cap on any decider's choice (bounds lookahead slots and verify width)
    draft_model: str | None = None  # for "draft": HF directory or .gguf with the target's vocabulary
    draft_layers: int = 4  # for "layer-skip": the target's first N layers
    # For "eagle" and "chain": an EAGLE-3 head folder (`specplan train-draft`); None: the head
    # shipped for the target (engine/proposers/heads/).
    draft_head: str | None = None
    # How the head's projections are stored where the engine's CPU kernels run: "q8_0" (blocks of
    # 32 int8 with a scale: a draft pass streams 3.8x fewer bytes than fp32; measured in
    # reports/eagle) or "fp32" (the checkpoint's weights as they are). Elsewhere always as stored.
    draft_head_weights: str = "q8_0"
    # For "chain": n-gram drafts where the lookup matched at least this many tokens, the head's
    # elsewhere. 2: the shipped SmolLM2 head's first draft is accepted about as often as a 2-token
    # match's lookup (0.46-0.49 against 0.39-0.56 on GSM8K and MT-Bench at B = 4), far more often
    # than a 1-token match's (0.19-0.30), and a lookup costs no head pass (reports/eagle).
    chain_min_match: int = 2
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.draft_head_weights not in ("q8_0", "fp32"):
            raise ValueError(f"draft_head_weights must be q8_0 or fp32, got {self.draft_head_weights!r}")
