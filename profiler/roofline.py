"""A step's arithmetic intensity from the profile's cost constants, against the machine's ridge.

The roofline policy asks it whether a step *as it would run with k drafts each* is still
memory-bound (planner/policy.py ``Roofline`` is the interface it reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from .latency_model import StepShape


@dataclass(frozen=True)
class LinearRoofline:
    """Step FLOPs and bytes linear in the step's aggregates (docs/design.md §5's accounting):

    flops = flops_per_token * num_tokens + attention_flops * num_tokens * (context_tokens / num_seqs)
    bytes = bytes_per_step (weights, read once) + bytes_per_token (activations)
            + bytes_per_context_token (KV reads)
    """

    ridge: float  # FLOP/byte where the machine's roofline bends
    flops_per_token: float  # ~2 * parameters for a dense decoder
    bytes_per_step: float  # weight bytes
    bytes_per_token: float = 0.0
    bytes_per_context_token: float = 0.0
    attention_flops: float = 0.0  # per query token per context token it attends to

    def intensity(self, shape: StepShape) -> float:
        avg_ctx = shape.context_tokens / max(shape.num_seqs, 1)
        flops = shape.num_tokens * (self.flops_per_token + self.attention_flops * avg_ctx)
        moved = (self.bytes_per_step + self.bytes_per_token * shape.num_tokens
                 + self.bytes_per_context_token * shape.context_tokens)
        return flops / moved
