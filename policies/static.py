"""``static:K``: the same k for every request, every step (what serving stacks ship today)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.policy import PolicyState


@dataclass(frozen=True)
class StaticPolicy:
    k: int
    requires: ClassVar[frozenset[str]] = frozenset()
    # A request with no draft found runs none, whatever k it is given: counting it is enough (Policy.choose).
    counts_idle_requests: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"static k must be >= 0, got {self.k}")

    @property
    def name(self) -> str:
        return f"static:{self.k}"

    def choose(self, state: PolicyState) -> list[int]:
        return state.capped(self.k)

    def may_pay(self, state: PolicyState) -> bool:
        """The planner's screen (controller.py ``may_speculate``): ``static:0`` never drafts, so
        its steps need no lookup and no decision (as the engine's own SD off)."""
        return self.k > 0 and state.max_k > 0
