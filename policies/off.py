"""``off``: never speculate (plain decoding, the baseline every policy must not fall below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.policy import PolicyState


@dataclass(frozen=True)
class OffPolicy:
    name: ClassVar[str] = "off"
    requires: ClassVar[frozenset[str]] = frozenset()
    # A request with no draft found runs none, whatever k it is given: counting it is enough (Policy.choose).
    counts_idle_requests: ClassVar[bool] = True

    def choose(self, state: PolicyState) -> list[int]:
        return [0] * len(state.requests)
