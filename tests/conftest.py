"""Shared fixtures: tiny random-weight Llama / Qwen2 models built in the test, no files, no hub."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@dataclass(frozen=True)
class RidgeLatency:
    """A synthetic latency model: flat up to ``ridge_tokens`` tokens per step, then ``b`` s per token,
    plus ``c`` s per KV token (for planner and policy tests)."""

    a: float
    b: float = 0.0
    c: float = 0.0
    ridge_tokens: int = 0

    def predict(self, shape) -> float:
        return self.a + self.b * max(0, shape.num_tokens - self.ridge_tokens) + self.c * shape.context_tokens


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (the SmolLM2/Qwen2 kind) trained offline on ``texts``, with ChatML-style
    special tokens (ids 0, 1, 2), a chat template and no EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_hf_model(arch: str = "llama", *, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A random-weight transformers model small enough to run a step in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=None, pad_token_id=None,
                  eos_token_id=None)
    common.update(overrides)
    if arch == "llama":
        cfg, cls = LlamaConfig(architectures=["LlamaForCausalLM"], **common), LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(architectures=["Qwen2ForCausalLM"], **common), Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    if arch == "qwen2":  # transformers initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    return model


def loaded_from_hf(model, name: str = "tiny"):
    from specplan.engine import LoadedModel, ModelConfig

    return LoadedModel(config=ModelConfig.from_hf(model.config, name=name),
                       weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                       tokenizer=None, path=Path("."), name=name)


def tiny_llm(model, *, dtype: torch.dtype = torch.float64, **kwargs):
    from specplan.engine import LLM

    kwargs.setdefault("kv_cache_bytes", 8 * 1024**2)
    kwargs.setdefault("block_size", 4)
    return LLM(loaded=loaded_from_hf(model), dtype=dtype, **kwargs)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_hf_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny_hf_model("qwen2")


def flat_profile(loaded):
    """A profile for ``loaded`` without measuring: 10 ms a step plus 0.5 ms a query token (enough
    to steer by, in tests that run a real model)."""
    import torch

    from specplan.profiler.fit import fit_latency_model
    from specplan.profiler.latency_model import StepShape
    from specplan.profiler.profile import CeilingsModel, CostConstants, FitError, Profile, fingerprint

    shapes = [StepShape(b, b * t, b * 100) for b in (1, 2, 4) for t in (1, 2, 4)]
    model = fit_latency_model(shapes, [0.01 + 0.0005 * s.num_tokens for s in shapes])
    return Profile(fingerprint=fingerprint(loaded.config, torch.float32, "cpu"),
                   ceilings=CeilingsModel(peak_flops=1e11, bandwidth=1e10, ridge=10.0),
                   cost=CostConstants(weight_bytes=5e8, flops_per_token=2.7e8, lm_head_flops_per_row=1e7,
                                      kv_bytes_per_token=1e4, attention_flops_per_token_pair=1e3),
                   latency_model=model.to_dict(), fit=FitError(heldout_mape=1, train_mape=1, roofline_mape=1,
                                                               num_cells=9, num_heldout=0),
                   max_batch=4, max_tokens_per_seq=4)


def assert_follows_marginals(outs, p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> None:
    """Sampled tokens 2 and 3 of ``outs`` (one prompt, n samples) follow the exact marginals of a
    target with p0 [V] = p(t0), p1 [V, V] = p(t1 | t0), p2 [V, V, V] = p(t2 | t0, t1) (chi-square,
    the cells expected below 5 draws pooled into one)."""
    from scipy.stats import chisquare

    n, vocab = len(outs), p0.shape[0]
    joint01 = p0[:, None] * p1  # [V, V]
    for position, want in zip((1, 2), (p0 @ p1, (joint01[:, :, None] * p2).sum((0, 1)))):
        got = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=vocab).double()
        support = want * n >= 5
        obs = torch.cat([got[support], got[~support].sum()[None]])
        exp = torch.cat([want[support], want[~support].sum()[None]]) * n
        assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4, position
