"""``static:K``: the same k for every request, every step (what serving stacks ship today)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.policy import PolicyState


@dataclass(frozen=True)
class StaticPolicy:
    k: int
    requires: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"static k must be >= 0, got {self.k}")

    @property
    def name(self) -> str:
        return f"static:{self.k}"

    def choose(self, state: PolicyState) -> list[int]:
        return state.capped(self.k)
