"""``goodput``: the default adaptive policy, per-request k maximising predicted step goodput.

Everything lives in planner/allocate.py (the greedy marginal-gain allocation under the SLA); this
file adapts it to the Policy interface. ``min_relative_gain`` is the margin by which speculation
must beat plain decoding before it is switched on: the latency model and the acceptance
estimates are not exact, and being slower than ``off`` is the failure users notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.allocate import Allocation, allocate
from .base import PolicyState


@dataclass(frozen=True)
class GoodputPolicy:
    min_relative_gain: float = 0.02
    # False for a latency model whose predictions may fall as tokens grow (then every total is tried).
    assume_monotone_latency: bool = True
    requires: ClassVar[frozenset[str]] = frozenset({"latency"})

    def __post_init__(self) -> None:
        if self.min_relative_gain < 0:
            raise ValueError(f"min_relative_gain must be >= 0, got {self.min_relative_gain}")

    @property
    def name(self) -> str:
        return "goodput" if self.min_relative_gain == 0.02 else f"goodput:{self.min_relative_gain:g}"

    def plan(self, state: PolicyState) -> Allocation:
        """The full allocation (predicted goodput and step time too), for reports and tests."""
        return allocate([r.acceptance for r in state.requests], [r.max_k for r in state.requests],
                        state.cost_model(), sla_itl_s=state.sla_itl_s,
                        min_relative_gain=self.min_relative_gain,
                        assume_monotone=self.assume_monotone_latency)

    def choose(self, state: PolicyState) -> list[int]:
        return list(self.plan(state).ks)
