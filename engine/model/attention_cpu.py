"""Paged attention on CPU without gathering the KV cache: a small C++ kernel (engine/model/csrc/).

The torch reference (engine/model/attention.py) copies every request's K and V out of the paged cache
(``k_cache[block_tables]``) in every layer. This kernel reads keys and values in place through the
block tables, handles GQA by processing the G query heads of one KV head together (no repeated
K/V), and keeps a streaming softmax per query row. Threads come from torch's intra-op pool.

Semantics equal ``paged_attention(q, k_cache, v_cache, AttentionPlan.build(batch, block_size,
H // KVH, sliding_window), scale)`` up to rounding (float32 or float64), draft trees included:
their rows see what ``batch.tree_bits`` says (built by the model runner beside ``tree_masks``, for
trees of up to 63 nodes). A tree batch without ``tree_bits`` is not handled (``supports`` says
which path a step takes); before the kernel knew trees, one suffix-tree request sent the whole
batch through the reference, which copies every request's K/V out of the cache in every layer.

The kernel is built with the engine's other CPU kernels (engine/model/cpu_kernels.py); without a
compiler, or with ``SPECPLAN_CPU_KERNELS=0``, ``load_kernel`` returns None.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import cpu_kernels
from ..batch import TokenBatch


def load_kernel() -> Callable | None:
    """The compiled op (compiling the CPU kernels on first use), or None if they cannot be built
    here; callers then use the torch reference."""
    return torch.ops.specplan_attn.paged_attention_cpu if cpu_kernels.load() else None


def supports(batch: TokenBatch, dtype: torch.dtype, device: torch.device | str,
             kv_dtype: torch.dtype | None = None, head_dim: int = 64) -> bool:
    """Whether ``paged_attention_cpu`` takes this step: CPU, float32/float64, trees (if any) given
    as ``tree_bits``, and the kernel compiled. ``kv_dtype``: the cache's (None: ``dtype``); a
    float16 cache with float32 queries is read by the kernel at head_dim 64 or 128
    (``half_cache_supported``). Decide once per step; otherwise use the reference with an
    AttentionPlan."""
    if kv_dtype is not None and kv_dtype != dtype and not (kv_dtype == torch.float16 and dtype == torch.float32
                                                           and half_cache_supported(head_dim)):
        return False
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
            and (not batch.tree_masks or batch.tree_bits is not None) and load_kernel() is not None)


def half_cache_supported(head_dim: int) -> bool:
    """Whether the kernel reads a float16 KV cache of this head size (its fast path's sizes)."""
    return head_dim in (64, 128)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: TokenBatch,
                        scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [N, H, D] -> out [N, H, D]; keys/values are read in place from the paged caches
    ([num_blocks, block_size, KVH, D], this step's K/V already written).

    Raises ValueError for a tree batch without ``tree_bits`` (route it to
    engine/model/attention.py's paged_attention) and RuntimeError if the kernel could not be
    built (check ``supports`` first).
    """
    if batch.tree_masks and batch.tree_bits is None:
        raise ValueError("paged_attention_cpu needs batch.tree_bits for tree-masked requests; use the torch reference")
    op = load_kernel()
    if op is None:
        raise RuntimeError("CPU paged-attention kernel unavailable; use the torch reference")
    # The batch's index tensors go in as built (TokenBatch documents their dtypes; the op checks
    # them): converting them again in every layer cost a visible share of a B=1 step
    # (measured: reports/README.md#engine-measurements).
    return op(q.contiguous(), k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
              batch.positions, float(scale), int(sliding_window or 0), batch.tree_bits)
