"""Attention over the paged KV cache (torch reference path; runs on any device).

KV cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and the
same for values, indexed in that order whatever the storage (the engine stores it head-major and
hands out a strided view; see model_runner.allocate_kv_cache). A request's keys at positions
0..L-1 live in the blocks of its block table, so ``k_cache[block_table].flatten(0, 1)[:L]`` reads
them in order.

GQA without repeating K/V: query heads ``h = kv * G + g`` (G = heads per KV head) share KV head
``kv``, so the G query heads of one KV head are folded into the query axis and each KV head does
one [T*G, D] x [D, L] product: on CPU far faster than SDPA's ``enable_gqa``
(measured: reports/README.md#engine-measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..batch import TokenBatch

# Requests with at most this many query tokens (decodes, verifies) run together in one padded
# batch; longer ones (prefill chunks) run one at a time so no decode is padded to a prompt's length.
MAX_BATCHED_QUERY_LEN = 16


@dataclass
class _PaddedGroup:
    """Requests attended together: their queries padded to ``max_q`` rows."""

    token_index: torch.Tensor  # [b, max_q] int64, row of the flat batch for each padded query
    valid: torch.Tensor  # [b, max_q] bool, False for padding rows
    block_tables: torch.Tensor  # [b, num_blocks] int32
    mask: torch.Tensor  # [b, 1, max_q * G, num_blocks * block_size] bool, True = may attend


@dataclass
class AttentionPlan:
    """Index tensors shared by every layer of one forward pass (built once per step)."""

    groups: list[_PaddedGroup]

    @staticmethod
    def build(batch: TokenBatch, block_size: int, group_size: int, sliding_window: int | None) -> "AttentionPlan":
        device = batch.input_ids.device
        starts = [0]
        for n in batch.query_lens_host:
            starts.append(starts[-1] + n)
        trees = batch.tree_masks or {}
        short = [i for i, n in enumerate(batch.query_lens_host) if n <= MAX_BATCHED_QUERY_LEN or i in trees]
        long = [i for i, n in enumerate(batch.query_lens_host) if n > MAX_BATCHED_QUERY_LEN and i not in trees]
        members = ([short] if short else []) + [[i] for i in long]
        groups = []
        for reqs in members:
            max_q = max(batch.query_lens_host[i] for i in reqs)
            max_len = max(batch.seq_lens_host[i] for i in reqs)
            num_blocks = -(-max_len // block_size)
            rows, valid = [], []
            for i in reqs:
                n = batch.query_lens_host[i]
                rows.append([starts[i] + min(t, n - 1) for t in range(max_q)])
                valid.append([t < n for t in range(max_q)])
            token_index = torch.tensor(rows, dtype=torch.int64, device=device)  # [b, max_q]
            valid_t = torch.tensor(valid, dtype=torch.bool, device=device)  # [b, max_q]
            q_pos = batch.positions[token_index]  # [b, max_q]
            k_pos = torch.arange(num_blocks * block_size, device=device)  # [L]
            mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [b, max_q, L] causal
            if sliding_window is not None:
                mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
            for row, i in enumerate(reqs):
                if i in trees:  # context (slots < c) plus the node's ancestors among the tree's slots
                    nodes = batch.query_lens_host[i]
                    c = batch.seq_lens_host[i] - nodes
                    mask[row, :, c:] = False
                    mask[row, :nodes, :c] = True
                    mask[row, :nodes, c:c + nodes] = trees[i]
                    mask[row, nodes:] = mask[row, nodes - 1]  # padding rows copy a real row
            mask = mask[:, :, None, :].expand(-1, -1, group_size, -1)  # [b, max_q, G, L]
            mask = mask.reshape(len(reqs), 1, max_q * group_size, -1)  # [b, 1, max_q*G, L]
            idx = torch.tensor(reqs, dtype=torch.int64, device=device)
            block_tables = batch.block_tables[idx, :num_blocks]  # [b, num_blocks]
            groups.append(_PaddedGroup(token_index, valid_t, block_tables, mask))
        return AttentionPlan(groups)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([N, kv_heads, D]) at their slots, in the cache's dtype (a
    float16 cache rounds them to nearest even, as the CPU kernel does)."""
    block_size = k_cache.shape[1]
    block, offset = slot_mapping // block_size, slot_mapping % block_size  # [N] each
    # Indexing, not .view: the cache may be a strided (head-major) view.
    k_cache[block, offset] = k.to(k_cache.dtype)
    v_cache[block, offset] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                    scale: float) -> torch.Tensor:
    """q: [N, H, D] -> out [N, H, D]; keys/values come from the cache (this step's already written),
    widened to q's dtype when the cache is stored narrower (float16)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    for g in plan.groups:
        b, max_q = g.token_index.shape
        qg = q[g.token_index]  # [b, max_q, H, D]
        qg = qg.view(b, max_q, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        qg = qg.reshape(b, kv_heads, max_q * group, head_dim)  # [b, KVH, max_q*G, D]
        k = k_cache[g.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [b, KVH, L, D]
        v = v_cache[g.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [b, KVH, L, D]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)  # [b, KVH, max_q*G, D]
        o = o.view(b, kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)  # [b, max_q, KVH, G, D]
        o = o.reshape(b, max_q, num_heads, head_dim)
        out[g.token_index[g.valid]] = o[g.valid]
    return out
