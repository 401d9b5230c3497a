"""What the planner needs from a profile: a prediction of one engine step's wall time, and what
drafting adds to it.

A step is summarised by three aggregates (as in SmartSpec's batch-latency model): how many
sequences it runs, how many query tokens its forward pass processes (decodes, verify tokens and
prefill chunks together), and how many KV tokens its attention reads. The profiler fits a model
of this form from measured steps; the planner asks it about candidate choices of k, many times
per step, so ``predict`` must be a handful of float operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


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


def predict_added(model: LatencyModel, base: StepShape, count: int) -> list[float]:
    """[count + 1]: the model's seconds for ``base`` with 0, 1, ..., count more query tokens, each
    also one more KV token read (a step's drafts: planner/goodput.py ``with_drafts``), as plain
    floats. The planner asks this of short curves every step (count = B x k <= 64 at small
    batches), where numpy's per-call cost is most of the work: a model with ``predict_added`` (the
    fitted one; the drift-corrected one) answers in plain Python, with the same floats as
    ``predict_many``; any other model goes through ``predict_many``."""
    added = getattr(model, "predict_added", None)
    if added is not None:
        return added(base, count)
    n = np.arange(count + 1)  # [count + 1]
    return predict_many(model, base.num_seqs, base.num_tokens + n, base.context_tokens + n).tolist()


def predict_many(model: LatencyModel, num_seqs: int, num_tokens: np.ndarray, context_tokens: np.ndarray
                 ) -> np.ndarray:
    """The model's seconds for steps of ``num_seqs`` sequences and each of the token counts
    (arrays of one length): one vectorised call where the model has ``predict_many`` (the fitted
    model has), else one ``predict`` per entry, which is exact for any model."""
    many = getattr(model, "predict_many", None)
    if many is not None:
        return many(num_seqs, num_tokens, context_tokens)
    return np.array([model.predict(StepShape(num_seqs, int(n), int(c))) for n, c in zip(num_tokens, context_tokens)])


@dataclass(frozen=True)
class DraftCost:
    """Drafting time of one step, as the profile measured it and the planner prices it.

    ``per_pass_s`` is paid once per draft position up to the deepest k in the batch (a draft
    model runs one batched pass per position, a fraction of a target step); ``per_token_s`` once
    per draft token (lookup work). An n-gram or suffix proposer is ~0 on both.
    """

    per_pass_s: float = 0.0
    per_token_s: float = 0.0

    def seconds(self, total_drafts: int, deepest_k: int) -> float:
        return self.per_pass_s * deepest_k + self.per_token_s * total_drafts
