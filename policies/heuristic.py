"""``heuristic``: Hugging Face assisted generation's schedule, per request.

Each request starts at ``start_k``; after a step in which every proposed draft was accepted its k
grows by 2, otherwise it shrinks by 1, never below 1 (HF never turns speculation off this way) nor
above the request's cap. It looks only at acceptance, never at what the step costs: the baseline
that shows why acceptance alone cannot decide k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..planner.policy import Outcome, PolicyState


def next_k(k: int, outcome: Outcome) -> int:
    """HF's update: +2 when all drafts were accepted, -1 otherwise, floor 1."""
    all_accepted = outcome.num_proposed > 0 and outcome.num_accepted >= outcome.num_proposed
    return k + 2 if all_accepted else max(1, k - 1)


@dataclass
class HeuristicPolicy:
    start_k: int = 4
    requires: ClassVar[frozenset[str]] = frozenset()
    # seq_id -> (current k, steps_observed when it was last updated)
    _k: dict[int, tuple[int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.start_k < 1:
            raise ValueError(f"heuristic start k must be >= 1, got {self.start_k}")

    @property
    def name(self) -> str:
        return "heuristic" if self.start_k == 4 else f"heuristic:{self.start_k}"

    def choose(self, state: PolicyState) -> list[int]:
        out, seen = [], {}
        for r in state.requests:
            k, stamp = self._k.get(r.seq_id, (self.start_k, 0))
            if r.last_outcome is not None and r.steps_observed != stamp:
                k = next_k(k, r.last_outcome)
                stamp = r.steps_observed
            k = min(k, max(state.max_k, 1))  # HF clamps to its maximum too, so a miss bites at once
            seen[r.seq_id] = (k, stamp)
            out.append(min(k, r.max_k))
        self._k = seen  # requests no longer in the batch are forgotten
        return out
