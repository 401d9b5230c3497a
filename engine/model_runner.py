"""The model runner: the only part of the engine that builds tensors.

It owns the model and the KV cache tensor, turns the scheduler's plain-Python decisions into a
TokenBatch, runs the forward pass and returns the logits the sampler needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import TokenBatch
from .block_manager import BlockManager
from .config import CacheConfig, ModelConfig
from .model import Model
from .sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: feed ``token_ids`` at positions start.., need ``num_logits``."""

    seq: Sequence
    token_ids: list[int]  # query tokens fed this step (a prefill chunk, the last token, or 1 + drafts)
    start_position: int  # position of token_ids[0] (= tokens already in the KV cache)
    num_logits: int  # logits wanted for the last num_logits query tokens (0: mid-prefill chunk)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


class ModelRunner:
    def __init__(self, model: Model, cache_config: CacheConfig):
        self.model = model
        self.block_size = cache_config.block_size
        c = model.config
        self.num_blocks = cache_config.kv_cache_bytes // kv_bytes_per_block(c, self.block_size, model.dtype)
        # [num_layers, 2 (K, V), num_blocks, block_size, KVH, D]; zeros so padded reads stay finite.
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, max(self.num_blocks, 1), self.block_size, c.num_kv_heads, c.head_dim),
            dtype=model.dtype, device=model.device,
        )

    def build_batch(self, scheduled: list[ScheduledSeq], block_manager: BlockManager) -> TokenBatch:
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_indices = [], [], []
        for s in scheduled:
            n = len(s.token_ids)
            offset = len(input_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_position, s.start_position + n)
            positions.extend(pos)
            slots.extend(block_manager.slot(s.seq, p) for p in pos)
            query_lens.append(n)
            seq_lens.append(s.start_position + n)
            logits_indices.extend(range(offset + n - s.num_logits, offset + n))
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
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
            logits_indices=t(logits_indices, torch.int64),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )

    def execute(self, batch: TokenBatch) -> torch.Tensor:
        """Run one forward pass; logits [len(logits_indices), V] in fp32."""
        hidden = self.model.forward(batch, self.kv_cache, self.block_size)
        return self.model.compute_logits(hidden[batch.logits_indices])
