"""``roofline``: speculate with a fixed k while the step stays memory-bound, off past the ridge.

Arithmetic intensity (FLOP per byte moved) of the step *as it would run with k drafts each* is
compared with the machine's ridge point (peak FLOP/s / bandwidth). Below the ridge the extra verify
tokens ride along on the weight reads almost for free; past it they cost compute time. It ignores
acceptance and the measured latency (on a CPU small-row matrix products sit far from either
ceiling), which is why the goodput policy exists; it is the textbook baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..profiler.latency_model import StepShape
from .base import PolicyState


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


@dataclass(frozen=True)
class RooflinePolicy:
    k: int = 4
    requires: ClassVar[frozenset[str]] = frozenset({"roofline"})

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"roofline k must be >= 0, got {self.k}")

    @property
    def name(self) -> str:
        return "roofline" if self.k == 4 else f"roofline:{self.k}"

    def choose(self, state: PolicyState) -> list[int]:
        if state.roofline is None:
            raise ValueError("the roofline policy needs the step's arithmetic intensity: "
                             "give the planner a roofline (e.g. LinearRoofline from the profile)")
        ks = state.capped(self.k)
        if state.roofline.intensity(state.shape_with(sum(ks))) > state.roofline.ridge:
            return [0] * len(ks)
        return ks
