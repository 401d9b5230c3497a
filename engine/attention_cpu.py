"""Paged attention on CPU without gathering the KV cache: a small C++ kernel (engine/csrc/).

The torch reference (engine/attention.py) copies every request's K and V out of the paged cache
(``k_cache[block_tables]``) in every layer. This kernel reads keys and values in place through the
block tables, handles GQA by processing the G query heads of one KV head together (no repeated
K/V), and keeps a streaming softmax per query row. Threads come from torch's intra-op pool.

Semantics equal ``paged_attention(q, k_cache, v_cache, AttentionPlan.build(batch, block_size,
H // KVH, sliding_window), scale)`` up to rounding (float32 or float64) for batches WITHOUT tree
masks. Tree-masked requests (``batch.tree_masks``) are not handled: ``paged_attention_cpu``
raises ``ValueError`` for such a batch and the caller must run it through the torch reference
(``supports`` says which path a step takes).

The extension is compiled on first use (``load_kernel``; about 15-30 s on 2 cores) and cached
by torch.utils.cpp_extension under ``$SPECPLAN_CACHE/torch_extensions`` when SPECPLAN_CACHE is
set, else torch's default extensions directory (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``); later processes only load the cached library. Set
``SPECPLAN_CPU_ATTENTION_KERNEL=0`` to disable the kernel (``load_kernel`` then returns None).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from .batch import TokenBatch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_OP_NAMESPACE = "specplan_attn"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "kernel": callable | None once load_kernel has run


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_config() -> tuple[str, list[str]]:
    """(extension name, compiler flags): AVX2+FMA only when this CPU has them (no -march=native,
    so a cache shared between machines never hands one CPU another's instructions)."""
    # -fopenmp: at::parallel_for is header code that only runs threads when _OPENMP is defined;
    # the extension then shares torch's already-loaded libgomp (same soname), i.e. its thread pool.
    flags = ["-O3", "-fopenmp"]
    if {"avx2", "fma"} <= _cpu_flags():
        return "specplan_paged_attention_avx2", flags + ["-mavx2", "-mfma"]
    # -Wno-psabi: GCC notes that 32-byte vector arguments change ABI without AVX (internal only).
    return "specplan_paged_attention_generic", flags + ["-Wno-psabi"]


def _registered_op() -> Callable | None:
    try:
        return getattr(getattr(torch.ops, _OP_NAMESPACE), "paged_attention_cpu")
    except (AttributeError, RuntimeError):
        return None


def _compile() -> Callable:
    op = _registered_op()
    if op is not None:  # already loaded in this process
        return op
    from torch.utils import cpp_extension

    if not _SOURCE.is_file():
        raise FileNotFoundError(f"kernel source missing: {_SOURCE}")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    name, cflags = _build_config()
    build_dir = None
    if os.environ.get("SPECPLAN_CACHE"):
        build_dir = Path(os.environ["SPECPLAN_CACHE"]) / "torch_extensions" / name
        build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading CPU paged-attention kernel %s (compiles on first use)", name)
    cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                       build_directory=None if build_dir is None else str(build_dir),
                       is_python_module=False, verbose=False)
    op = _registered_op()
    if op is None:
        raise RuntimeError(f"extension {name} loaded but torch.ops.{_OP_NAMESPACE}.paged_attention_cpu is missing")
    return op


def load_kernel() -> Callable | None:
    """The compiled op (compiling it on first use), or None, with one warning, if it cannot be
    built here (no compiler, build error, disabled); callers then use the torch reference."""
    with _lock:
        if "kernel" not in _state:
            if os.environ.get("SPECPLAN_CPU_ATTENTION_KERNEL", "1") == "0":
                _state["kernel"] = None
            else:
                try:
                    _state["kernel"] = _compile()
                except Exception as e:  # noqa: BLE001 -- any failure means "use the reference"
                    first = (str(e).strip().splitlines() or [""])[0]
                    warnings.warn(f"specplan: CPU paged-attention kernel unavailable ({type(e).__name__}: "
                                  f"{first}); using the torch reference", RuntimeWarning, stacklevel=2)
                    _state["kernel"] = None
        return _state["kernel"]  # type: ignore[return-value]


def supports(batch: TokenBatch, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``paged_attention_cpu`` takes this step: CPU, float32/float64, no tree masks, and
    the kernel compiled. Decide once per step; otherwise use the reference with an AttentionPlan."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
            and not batch.tree_masks and load_kernel() is not None)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TokenBatch,
                        scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [N, H, D] -> out [N, H, D]; keys/values are read in place from the paged caches
    ([num_blocks, block_size, KVH, D], this step's K/V already written).

    Raises ValueError for a batch with tree masks (route it to engine.attention.paged_attention)
    and RuntimeError if the kernel could not be built (check ``supports`` first).
    """
    if batch.tree_masks:
        raise ValueError("paged_attention_cpu does not handle tree-masked requests; use the torch reference")
    op = load_kernel()
    if op is None:
        raise RuntimeError("CPU paged-attention kernel unavailable; use the torch reference")
    return op(q.contiguous(), k_cache, v_cache,
              batch.query_start_loc.to(torch.int32).contiguous(),
              batch.seq_lens.to(torch.int32).contiguous(),
              batch.block_tables.to(torch.int32).contiguous(),
              batch.positions.to(torch.int64).contiguous(),
              float(scale), int(sliding_window or 0))
