"""``oracle``: the best static k in hindsight, for reports (not a serving policy).

Given measured goodput per static k for each cell of an evaluation (e.g. (workload, batch size)),
it plays the k that turned out best in that cell. Comparing the adaptive policy with it answers
"how close to the best fixed choice did we get without knowing the answer in advance".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Mapping

from ..planner.policy import PolicyState


def best_static_k(goodput_by_k: Mapping[int, float]) -> int:
    """The k with the highest measured goodput (the smaller k on a tie: cheaper, same result)."""
    if not goodput_by_k:
        raise ValueError("no measurements: the oracle needs goodput for at least one static k")
    return max(sorted(goodput_by_k), key=lambda k: goodput_by_k[k])


@dataclass(frozen=True)
class OraclePolicy:
    """``table`` maps a cell to {static k: measured goodput}. The cell is fixed (``cell``) when one
    run is one cell, or derived from the state as (workload, batch size), taking the nearest
    measured batch size of that workload when the live batch differs (requests finishing)."""

    table: Mapping[Hashable, Mapping[int, float]]
    cell: Hashable | None = None
    requires: ClassVar[frozenset[str]] = frozenset()
    # A request with no draft found runs none, whatever k it is given: counting it is enough (Policy.choose).
    counts_idle_requests: ClassVar[bool] = True
    name: ClassVar[str] = "oracle"

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("the oracle needs a table of measured goodput per static k per cell")
        if self.cell is not None and self.cell not in self.table:
            raise ValueError(f"cell {self.cell!r} is not in the oracle's table")

    def k_for(self, cell: Hashable) -> int:
        return best_static_k(self.table[cell])

    def _cell_of(self, state: PolicyState) -> Hashable:
        if self.cell is not None:
            return self.cell
        key = (state.workload, state.batch_size)
        if key in self.table:
            return key
        same = [c for c in self.table if isinstance(c, tuple) and len(c) == 2 and c[0] == state.workload]
        if not same:
            raise ValueError(f"the oracle's table has no cell for workload {state.workload!r}")
        return min(same, key=lambda c: (abs(c[1] - state.batch_size), c[1]))

    def choose(self, state: PolicyState) -> list[int]:
        return state.capped(self.k_for(self._cell_of(state)))
