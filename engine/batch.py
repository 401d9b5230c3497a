"""TokenBatch: one flattened forward pass over many requests.

Every request contributes its own number of query tokens: a prefill chunk, one decode token, or
1 + k verify tokens. One convention for offsets everywhere: ``query_start_loc`` is cumulative,
[B+1], int32, starting at 0.

Worked example (block_size 4). Three requests:
  r0 prefills 3 prompt tokens at positions 0..2         (context before: 0, seq_len after: 3)
  r1 decodes 1 token at position 9                      (context before: 9, seq_len after: 10)
  r2 verifies 1 + 2 drafts at positions 5, 6, 7         (context before: 5, seq_len after: 8)

  input_ids       = [a0 a1 a2 | b9 | c5 c6 c7]            N = 7
  positions       = [ 0  1  2 |  9 |  5  6  7]
  query_start_loc = [0, 3, 4, 7]
  seq_lens        = [3, 10, 8]
  slot_mapping[i] = block_table[req][pos // 4] * 4 + pos % 4   (where token i's K/V is written)

A query token at position p of request r attends to that request's keys at positions 0..p.

Tree verification (several candidate continuations in one pass): a request's query tokens are
the nodes of a draft tree, node t written to the KV slot of position c + t (c = tokens already
cached) but rotated at position c + depth(t); it attends to the cached context and to its own
ancestors. ``tree_masks`` holds, per such request, the [nodes, nodes] ancestor-or-self matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query tokens per request
    seq_lens: torch.Tensor  # [B] int32, tokens in the KV cache per request after this step
    slot_mapping: torch.Tensor  # [N] int64, flat KV slot each token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor  # [L] int64, rows of the flattened batch whose logits we need
    # Host-side copies so attention can plan without syncing the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # request index -> [num_nodes, num_nodes] bool, True where node t may attend to node u
    tree_masks: dict[int, torch.Tensor] | None = None
    # The same as bits for the CPU kernel: [N] int64, a tree request's row t has bit u set iff it
    # may attend to node u (0 for every other row). None without trees or with a tree of > 63 nodes.
    tree_bits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)
