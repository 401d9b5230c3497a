"""What the planner needs from a profile: a prediction of one engine step's wall time.

A step is summarised by three aggregates (as in SmartSpec's batch-latency model): how many
sequences it runs, how many query tokens its forward pass processes (decodes, verify tokens and
prefill chunks together), and how many KV tokens its attention reads. The profiler fits a model
of this form from measured steps; the planner asks it about candidate choices of k, many times
per step, so ``predict`` must be a handful of float operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class StepShape:
    num_seqs: int  # sequences in the step (B)
    num_tokens: int  # query tokens in the forward pass (sum over sequences of 1 + k_i, plus prefill)
    context_tokens: int  # KV tokens read by attention, summed over sequences


@runtime_checkable
class LatencyModel(Protocol):
    def predict(self, shape: StepShape) -> float:
        """Predicted time of one engine step's forward pass plus verification (StepRecord.forward_s +
        verify_s), in seconds; scheduling and proposing are priced separately by the planner."""
        ...
