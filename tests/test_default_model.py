"""The embedded default model (SmolLM2-135M-Instruct) matches Hugging Face transformers.

Marked slow: loads the real model (the first load converts the GGUF, ~40 s, then it is cached)
and runs transformers' generate for comparison. Run alone with ``pytest -m slow``.
"""

from __future__ import annotations

import pytest
import torch

from specplan.engine import LLM, SamplingParams, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is",
    "Summarize in one sentence: The city council met on Tuesday to discuss the new park, which will "
    "open next spring after two years of construction and a budget increase approved in March.",
    "Q: A farmer has 17 sheep and buys 5 more. How many sheep does he have?\nA:",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef normalize(x):",
    "Translate to French: Good morning, how are you?",
    "List three prime numbers greater than 100:",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


@pytest.fixture(scope="module")
def hf_model(loaded):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32, local_files_only=True).eval()


def test_default_model_greedy_matches_transformers(loaded, hf_model):
    llm = LLM(loaded=loaded)
    chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[4:6]]
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS] + chat
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), llm.tokenizer.decode(prompt)


def test_default_model_chat_and_stop_string(loaded):
    llm = LLM(loaded=loaded)
    out = llm.chat([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                   SamplingParams(temperature=0.0, max_tokens=48))[0]
    assert out.finish_reason == "stop" and "4" in out.text
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    word = full.text.split()[2]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop=[word], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)


@pytest.mark.parametrize("proposer,k", [("ngram", 4), ("suffix", 8), ("layer-skip", 2)])
def test_default_model_speculation_is_lossless(loaded, proposer, k):
    plain = LLM(loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS[:4], params)]
    spec = LLM(loaded=loaded, speculative_config={"proposer": proposer, "k": k, "draft_layers": 8})
    assert [o.token_ids for o in spec.generate(PROMPTS[:4], params)] == expected
    assert spec.engine.stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def loaded_q4():
    return load_model(None, quantize="gguf")


@pytest.mark.parametrize("proposer,k", [("ngram", 4), ("layer-skip", 2), ("eagle", 3)])
def test_default_model_quantized_speculation_is_lossless(loaded_q4, proposer, k):
    """The GGUF's own Q4_1 blocks with the float16 KV cache auto gives them: speculation is
    token-for-token plain greedy decoding over the same weights and cache (verify rows of the
    attention kernel equal the decode rows bit for bit with either cache type)."""
    plain = LLM(loaded=loaded_q4)
    assert plain.engine.kv_dtype == torch.float16
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS[:4], params)]
    spec = LLM(loaded=loaded_q4, speculative_config={"proposer": proposer, "k": k, "draft_layers": 8})
    assert [o.token_ids for o in spec.generate(PROMPTS[:4], params)] == expected
    assert spec.engine.stats.num_accepted_tokens > 0
