"""The model runner: the only part of the engine that builds tensors.

It owns the model and the KV cache tensor, turns the scheduler's plain-Python decisions into a
TokenBatch, runs the forward pass and returns the logits the sampler needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import TokenBatch
from .block_manager import BlockManager
from .config import ModelConfig
from .model.huge_pages import huge_page_zeros
from .model.transformer import Model
from .drafts import DraftTree
from .sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: feed ``token_ids`` at positions start.., need ``num_logits``."""

    seq: Sequence
    token_ids: list[int]  # query tokens fed this step (a prefill chunk, the last token, or 1 + drafts)
    start_position: int  # position of token_ids[0] (= tokens already in the KV cache)
    num_logits: int  # logits wanted for the last num_logits query tokens (0: mid-prefill chunk)
    tree: DraftTree | None = None  # token_ids are this tree's nodes (root first)
    draft_probs: torch.Tensor | None = None  # [num_drafts, V] q of a sampled model draft; None = one-hot
    # Prompt logprobs: the positions of this chunk whose logits score the next prompt token. Their
    # rows come after every item's sampling rows (``build_batch``), so verification never sees them.
    scored_positions: range = range(0)

    @property
    def num_drafts(self) -> int:
        return max(self.num_logits - 1, 0)


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # what --kv-cache-dtype names


def kv_cache_dtype(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                   requested: torch.dtype | None = None) -> torch.dtype:
    """The KV cache's element type for a model computing in ``dtype``: ``requested`` (the engine's
    dtype or float16), or with None (auto) float16 where the weights are quantised and the CPU
    attention kernel reads a float16 cache (head_dim 64 or 128), else ``dtype``.

    Why float16 there: a quantised decode step streams ~6x fewer weight bytes, and the K/V it reads
    become a large share of the step (SmolLM2-135M: 46 KB a token in float32; at B = 32 and 300
    tokens of context, more bytes than the Q4_1 weights). llama.cpp keeps its cache in float16 by
    default too. Float32 weights keep a float32 cache: that engine is the parity reference."""
    if requested is not None:
        if requested not in (dtype, torch.float16):
            raise ValueError(f"KV cache dtype {requested} not supported with {dtype} compute: "
                             f"use {str(dtype).removeprefix('torch.')} or float16")
        return requested
    from .model.attention_cpu import half_cache_supported, load_kernel

    if (config.quantization and torch.device(device).type == "cpu" and dtype == torch.float32
            and half_cache_supported(config.head_dim) and load_kernel() is not None):
        return torch.float16
    return dtype


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """[num_layers, 2 (K, V), num_blocks, block_size, KVH, D]; zeros so padded reads stay finite.

    The index order is the one every reader uses (attention, rope_write_kv, copy_slots); the
    storage is head-major, [..., num_blocks, KVH, block_size, D], and the tensor returned is that
    storage with its two middle dims swapped (a strided view: index it, never ``.view`` it). Why:
    a decode step reads each (block, KV head) of a request as one contiguous run of block_size * D
    values, where a token-major block interleaves the heads at a stride of KVH * D; that about
    halved a large decode step's attention (``python scripts/bench_kv_layout.py``)
    (measured: reports/README.md#engine-measurements).

    On CPU the storage sits on 2 MB pages (engine/model/huge_pages.py): fewer TLB misses when
    attention reads many requests' blocks (measured: reports/README.md#engine-measurements)."""
    shape = (config.num_layers, 2, max(num_blocks, 1), config.num_kv_heads, block_size, config.head_dim)
    if device.type == "cpu":
        storage = huge_page_zeros(shape, dtype)
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return storage.transpose(3, 4)


def layer_caches(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache) views [num_blocks, block_size, KVH, D] of a KV cache, made
    once: unbinding the cache in every step cost two view ops per layer, every step."""
    return [(k, v) for k, v in kv_cache]


class ModelRunner:
    """Runs ``model`` over the KV cache ``kv_cache`` (a draft model gets its own runner)."""

    def __init__(self, model: Model, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, KVH, D], head-major storage
        self.layer_caches = layer_caches(kv_cache)
        self.block_size = block_size

    def build_batch(self, scheduled: list[ScheduledSeq], block_manager: BlockManager) -> TokenBatch:
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_indices = [], [], []
        scored_indices: list[int] = []  # prompt-logprob rows, after all the sampling rows
        tree_masks: dict[int, torch.Tensor] = {}
        for i, s in enumerate(scheduled):
            n = len(s.token_ids)
            offset = len(input_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_position, s.start_position + n)
            slots.extend(block_manager.slot(s.seq, p) for p in pos)
            if s.tree is None:
                positions.extend(pos)
            else:  # node t sits in slot c + t but is rotated at its depth
                positions.extend(s.start_position + d for d in s.tree.depth())
                tree_masks[i] = _ancestor_mask(s.tree).to(device)
            query_lens.append(n)
            seq_lens.append(s.start_position + n)
            logits_indices.extend(range(offset + n - s.num_logits, offset + n))
            if s.scored_positions:
                scored_indices.extend(offset + p - s.start_position for p in s.scored_positions)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        # The CPU kernel takes a tree row's visible nodes as one int64 (bit 63 is the sign).
        bits_fit = bool(tree_masks) and all(len(s.tree.tokens) <= 63 for s in scheduled if s.tree is not None)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return TokenBatch(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            slot_mapping=t(slots, torch.int64),
            block_tables=t(tables, torch.int32),
            logits_indices=t(logits_indices + scored_indices, torch.int64),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            tree_masks=tree_masks or None,
            tree_bits=t(_tree_bits(scheduled), torch.int64) if bits_fit else None,
        )

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Move K/V (all layers) from slots src to slots dst: keeps an accepted tree branch."""
        bs, device = self.block_size, self.kv_cache.device
        src_t = torch.tensor(src, dtype=torch.int64, device=device)  # [n]
        dst_t = torch.tensor(dst, dtype=torch.int64, device=device)  # [n]
        # Slot s is (block s // bs, offset s % bs); the cache is a strided view, so index, not flatten.
        self.kv_cache[:, :, dst_t // bs, dst_t % bs] = self.kv_cache[:, :, src_t // bs, src_t % bs]

    def execute(self, batch: TokenBatch) -> torch.Tensor:
        """Run one forward pass; logits [len(logits_indices), V] in fp32: every item's sampling rows
        (num_logits each, in order), then every item's scored_positions rows (in order)."""
        hidden = self.model.forward(batch, self.layer_caches, self.block_size)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def execute_capturing(self, batch: TokenBatch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``execute``, also returning the residual stream entering ``layers`` for every query
        token: (logits as execute, captured [N, len(layers) * hidden]) for an EAGLE-3 head."""
        hidden, captured = self.model.forward_capturing(batch, self.layer_caches, self.block_size, layers)
        return self.model.compute_logits(hidden[batch.logits_indices]), captured


def _tree_bits(scheduled: list[ScheduledSeq]) -> list[int]:
    """Per query token of the batch: its tree node's _ancestor_bits, 0 outside trees."""
    bits: list[int] = []
    for s in scheduled:
        bits.extend(_ancestor_bits(s.tree) if s.tree is not None else [0] * len(s.token_ids))
    return bits


def _ancestor_bits(tree: DraftTree) -> list[int]:
    """Per node t, the bits of t and its ancestors: _ancestor_mask's rows as integers (bit u of
    row t = mask[t, u]); e.g. root -> {x, y}, x -> z gives [0b0001, 0b0011, 0b0101, 0b1011]."""
    bits = [1]
    for t in range(1, len(tree.tokens)):
        bits.append(bits[tree.parents[t]] | (1 << t))
    return bits


def _ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[nodes, nodes] bool: row t is True at t and at each of t's ancestors."""
    n = len(tree.tokens)
    mask = torch.eye(n, dtype=torch.bool)
    for t in range(1, n):
        mask[t] |= mask[tree.parents[t]]
    return mask
