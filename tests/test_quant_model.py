"""A quantized model end to end: speculation stays lossless against the quantized target, the
quantized model stays close to the float one, and GGUF blocks load as stored."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_follows_marginals, loaded_from_hf, tiny_hf_model
from specplan.bench.quant_bench import prefill_logits
from specplan.engine import LLM, ModelLoadError, SamplingParams, load_model
from specplan.engine.model.linear import packed_available
from specplan.engine.model.loader import quantize_model
from specplan.engine.model.linear import QuantLinear
from specplan.engine.model.quant import QuantWeight
from specplan.engine.model.transformer import Model
from test_loader import backend_tokenizer, write_tiny_gguf  # noqa: F401 -- a fixture
from test_spec_decode import repetitive_prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH")
    assert packed_available(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def model():
    # hidden 64, intermediate 96: multiples of the 32-weight block.
    return tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=3)


def _llm(loaded, **kwargs) -> LLM:
    return LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=8 * 1024**2, block_size=4, **kwargs)


@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_quantized_model_runs_the_quantized_kernels(model, scheme):
    loaded = quantize_model(loaded_from_hf(model), scheme)
    assert loaded.config.quantization == {"int8": "q8_0", "q4": "q4_1+q8_0"}[scheme]
    m = Model(loaded.config, loaded.weights, "cpu", torch.float32)
    linears = [m.lm_head] + [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(lin, QuantLinear) for lin in linears)
    assert m.kernel_stack is not None  # the C++ layer loop takes quantized weights too
    assert m.lm_head.fmt == "q8_0" and m.layers[0].qkv.fmt == ("q8_0" if scheme == "int8" else "q4_1")


@pytest.mark.parametrize("scheme", ["none", "int8", "q4"])
def test_the_compute_ceiling_times_the_kernels_of_the_models_weight_formats(model, scheme):
    """A quantized model's peak is measured with the engine's kernels for its block formats too:
    with int8 dot products they run 2-3x the fp32 kernel's FLOP/s, and a ceiling of fp32 alone
    put the roofline floor above steps the Q4_1 engine runs (the profile's ridge too low)."""
    from specplan.profiler.ceilings import peak_candidates

    loaded = loaded_from_hf(model) if scheme == "none" else quantize_model(loaded_from_hf(model), scheme)
    formats = loaded.weight_formats()
    assert formats == {"none": (), "int8": ("q8_0",), "q4": ("q4_1", "q8_0")}[scheme]
    candidates = peak_candidates(torch.device("cpu"), torch.float32, n=64, weight_formats=formats)
    labels = [label for label, _, _ in candidates]
    assert labels == ["torch mm", "engine float32", *(f"engine {fmt}" for fmt in formats)]
    product = {label: fn for label, _, fn in candidates}
    exact = product["engine float32"]()  # [256, 64]
    for fmt in formats:  # the same product, through that format's kernel: its rounding, not another product
        y = product[f"engine {fmt}"]()
        error = ((y - exact).norm() / exact.norm()).item()
        assert 0 < error < {"q8_0": 0.02, "q4_1": 0.2}[fmt]
        assert {label: flops for label, flops, _ in candidates}[f"engine {fmt}"] == 2.0 * 256 * 64 * 1024


@pytest.mark.parametrize("scheme", ["int8", "q4"])
@pytest.mark.parametrize("proposer,k", [("ngram", 4), ("layer-skip", 3)])
def test_greedy_speculation_is_lossless_on_the_quantized_target(model, scheme, proposer, k):
    loaded = quantize_model(loaded_from_hf(model), scheme)
    prompts = repetitive_prompts(model.config.vocab_size)
    expected = [o.token_ids for o in _llm(loaded).generate(prompts, GREEDY)]
    llm = _llm(loaded, speculative_config={"proposer": proposer, "k": k, "draft_layers": 2})
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.stats.num_accepted_tokens > 0, "nothing accepted: the verify path was never exercised"


@pytest.fixture(scope="module")
def model64():
    """Head size 64 (two query heads sharing one KV head): the size the CPU attention kernel reads
    a float16 cache at, so ``auto`` picks one for quantised weights."""
    return tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=3, hidden_size=128,
                         num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("proposer,k", [("ngram", 4), ("layer-skip", 3)])
def test_quantized_weights_get_a_float16_cache_and_speculation_stays_lossless(model64, proposer, k):
    """auto: quantised weights on CPU get a float16 KV cache (twice the tokens in the same budget),
    float32 weights keep float32. Greedy speculation over that cache is token-for-token the greedy
    output without it (both over float16), and close to the float32 cache's logits."""
    from specplan.engine.model_runner import kv_cache_dtype

    loaded = quantize_model(loaded_from_hf(model64), "q4")
    plain = _llm(loaded)
    assert plain.engine.kv_dtype == torch.float16
    assert kv_cache_dtype(loaded_from_hf(model64).config, torch.float32, "cpu") == torch.float32
    float_cache = _llm(loaded, kv_cache_dtype="float32")
    assert float_cache.engine.block_manager.num_blocks * 2 == plain.engine.block_manager.num_blocks
    prompts = repetitive_prompts(model64.config.vocab_size)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = _llm(loaded, speculative_config={"proposer": proposer, "k": k, "draft_layers": 2})
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.stats.num_accepted_tokens > 0, "nothing accepted: the verify path was never exercised"
    target = Model(loaded.config, loaded.weights, "cpu", torch.float32)
    with torch.no_grad():
        shortest = min(len(p) for p in prompts)
        half = _last_logits(target, [p[:shortest] for p in prompts], kv_dtype=torch.float16)
        full = _last_logits(target, [p[:shortest] for p in prompts])
    assert not torch.equal(half, full)  # the cache's rounding reached the logits...
    # ...and moved them little: the int8 rounding of activations in the quantised products
    # magnifies a last-bit change (max |diff| ~0.16 here against ~0.006 with float32 weights).
    assert F.cosine_similarity(half, full, dim=-1).min() > 0.998
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


def test_kv_cache_dtype_errors(model64):
    loaded = quantize_model(loaded_from_hf(model64), "q4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of float32, float16"):
        _llm(loaded, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="KV cache dtype torch.float32 not supported with torch.float64 compute"):
        LLM(loaded=loaded_from_hf(model64), dtype=torch.float64, kv_cache_bytes=8 * 1024**2, kv_cache_dtype="float32")


def _last_logits(model: Model, seqs: list[list[int]], block_size: int = 16, chunk: int = 1024,
                 kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [N, V] after each of N equal-length sequences, many sequences per prefill step, over
    a KV cache of ``kv_dtype``."""
    from specplan.engine.batch import TokenBatch
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    length = len(seqs[0])
    per_seq = -(-length // block_size)  # blocks per sequence
    out = []
    for start in range(0, len(seqs), chunk):
        part = seqs[start:start + chunk]
        n = len(part)
        starts = torch.arange(n + 1, dtype=torch.int32) * length  # [n + 1]
        # Sequence i owns blocks [i * per_seq, (i + 1) * per_seq): position p's slot is i * per_seq * block_size + p.
        slots = (torch.arange(n)[:, None] * per_seq * block_size + torch.arange(length)[None]).flatten()  # [n * length]
        batch = TokenBatch(input_ids=torch.tensor(part).flatten(), positions=torch.arange(length).repeat(n),
                           query_start_loc=starts, seq_lens=torch.full((n,), length, dtype=torch.int32),
                           slot_mapping=slots, block_tables=torch.arange(n * per_seq, dtype=torch.int32).view(n, per_seq),
                           logits_indices=starts[1:].long() - 1, query_lens_host=[length] * n,
                           seq_lens_host=[length] * n)
        cache = allocate_kv_cache(model.config, n * per_seq, block_size, kv_dtype, torch.device("cpu"))
        hidden = model.forward(batch, layer_caches(cache), block_size)  # [n * length, hidden]
        out.append(model.compute_logits(hidden[batch.logits_indices]))  # [n, V]
    return torch.cat(out)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_sampled_speculation_keeps_the_quantized_targets_distribution(model, kv_cache_dtype):
    """Sampled tokens 2 and 3 under layer-skip drafts (q != p, so rejection sampling resamples)
    follow the exact marginals of the *quantized* target, computed from its own logits over every
    context (chi-square): speculation is lossless against the model the engine actually runs,
    with its KV cache in float32 or float16 (the target is then the model over a float16 cache)."""
    loaded = quantize_model(loaded_from_hf(model), "q4")
    vocab, n = model.config.vocab_size, 3000
    prompt = repetitive_prompts(vocab, n=1, seed=5)[0][:8]
    llm = LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=64 * 1024**2, block_size=4, max_num_seqs=n,
              max_num_batched_tokens=40_000, kv_cache_dtype=kv_cache_dtype,
              speculative_config={"proposer": "layer-skip", "k": 2, "draft_layers": 1})
    kv_dtype = getattr(torch, kv_cache_dtype)
    assert llm.engine.kv_dtype == kv_dtype
    outs = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=1.0, n=n, seed=321))
    stats = llm.engine.stats
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    target = Model(loaded.config, loaded.weights, "cpu", torch.float32)
    with torch.no_grad():
        p0 = _last_logits(target, [prompt], kv_dtype=kv_dtype).double().softmax(-1)[0]  # [V]: p(t0)
        p1 = _last_logits(target, [prompt + [a] for a in range(vocab)], kv_dtype=kv_dtype
                          ).double().softmax(-1)  # [V, V]: p(t1 | t0)
        p2 = _last_logits(target, [prompt + [a, b] for a in range(vocab) for b in range(vocab)], kv_dtype=kv_dtype
                          ).double().softmax(-1).view(vocab, vocab, vocab)  # p(t2 | t0, t1)
    assert_follows_marginals(outs, p0, p1, p2)


@pytest.mark.parametrize("scheme,min_cosine,min_agreement", [("int8", 0.998, 0.9), ("q4", 0.9, 0.5)])
def test_quantized_logits_stay_close_to_float(model, scheme, min_cosine, min_agreement):
    """Teacher-forced over one sequence: the quantized model's logits against the float model's
    (mean cosine over positions), and how often their argmax (the greedy token) agrees. Random
    Gaussian weights are the hard case for 4 bits (no outliers to spend the range on, a 64-wide
    model with little averaging); the real model's perplexity is measured by bench quant."""
    ids = (repetitive_prompts(model.config.vocab_size, n=1, seed=7)[0] * 3)[:40]
    ref = _prefill_logits(loaded_from_hf(model), ids)  # [T, V]
    got = _prefill_logits(quantize_model(loaded_from_hf(model), scheme), ids)  # [T, V]
    cos = F.cosine_similarity(got, ref, dim=-1)  # [T]
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert cos.mean() > min_cosine and agreement >= min_agreement, (cos.mean(), agreement)


def _prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    return prefill_logits(Model(loaded.config, loaded.weights, "cpu", torch.float32), ids)  # [T, V]


# --- GGUF blocks as stored ------------------------------------------------------------------


def test_gguf_blocks_load_as_stored_and_match_the_float_conversion(tmp_path, backend_tokenizer):
    path = tmp_path / "src" / "Tiny.Q4_1.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, backend_tokenizer, projections="Q4_1", embedding="Q8_0")
    cache = tmp_path / "cache"
    floats = load_model(path, cache_dir=cache)
    quant = load_model(path, cache_dir=cache, quantize="gguf")
    assert quant.config.quantization == "q4_1+q8_0" and floats.config.quantization is None
    blocks = {name: w for name, w in quant.weights.items() if isinstance(w, QuantWeight)}
    assert len(blocks) == 2 * 7 + 1  # every projection of both layers, and the tied head
    for name, w in blocks.items():
        # transformers dequantizes the same blocks (and un-permutes the q/k rows): equal to the bit.
        ref = floats.weights.get(name, floats.weights["model.embed_tokens.weight"])
        assert torch.equal(w.dequantize(), ref), name
    assert blocks["lm_head.weight"].fmt == "q8_0" and blocks["model.layers.1.mlp.down_proj.weight"].fmt == "q4_1"
    assert not isinstance(quant.weights["model.embed_tokens.weight"], QuantWeight)  # lookups stay float
    # The engine on the blocks as stored: greedy tokens, with and without speculation, agree.
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    plain = _llm(quant).generate(prompt, GREEDY)[0].token_ids
    spec = _llm(quant, speculative_config={"proposer": "ngram", "k": 3}).generate(prompt, GREEDY)[0].token_ids
    assert len(plain) == 32 and spec == plain


def test_unsupported_gguf_type_names_it_and_the_supported_ones(tmp_path, backend_tokenizer):
    path = tmp_path / "Tiny.Q5_0.gguf"
    write_tiny_gguf(path, backend_tokenizer, projections="Q5_0")
    with pytest.raises(ModelLoadError) as e:
        load_model(path, cache_dir=tmp_path / "cache", quantize="gguf")
    message = str(e.value)
    assert "\n" not in message and "is Q5_0" in message and "Q8_0, Q4_0, Q4_1" in message
    assert not (tmp_path / "cache").exists()  # refused before the float conversion


def test_quantize_option_errors(tmp_path, backend_tokenizer):
    path = tmp_path / "Tiny.F32.gguf"
    write_tiny_gguf(path, backend_tokenizer)
    with pytest.raises(ModelLoadError, match="unknown quantization 'q3'"):
        load_model(path, quantize="q3")
    with pytest.raises(ModelLoadError, match="float32 activations"):
        load_model(path, dtype=torch.float64, quantize="int8")
    with pytest.raises(ModelLoadError, match="Hugging Face directory"):
        load_model(tmp_path, quantize="gguf")


@pytest.mark.parametrize("scheme", ["none", "int8", "q4"])
def test_bytes_per_weight_is_what_the_kernels_stream(model, scheme):
    """The profiler's roofline floor reads LoadedModel.bytes_per_weight: 4 for float32 weights, the
    blocks' own bytes for quantized ones (Q8_0 34/32, Q4_1 20/32 with a Q8_0 LM head), so its
    weight floor moves with the format instead of assuming 4 bytes."""
    from specplan.profiler.cost_model import weight_bytes

    loaded = quantize_model(loaded_from_hf(model), scheme)
    cfg = loaded.config
    head = cfg.vocab_size * cfg.hidden_size
    projections = weight_bytes(cfg, itemsize=0, weight_itemsize=1) - head  # products' weights, all layers
    expected = {"none": 4.0, "int8": 34 / 32,
                "q4": (projections * 20 / 32 + head * 34 / 32) / (projections + head)}[scheme]
    assert loaded.bytes_per_weight() == pytest.approx(expected)
    floor = weight_bytes(cfg, weight_itemsize=loaded.bytes_per_weight())
    assert (floor < weight_bytes(cfg)) == (scheme != "none")
