"""``batch_table``: k from the batch size, as vLLM's ``num_speculative_tokens_per_batch_size`` and
TensorRT-LLM's ``draft_len_schedule`` do: a hand-written table, the same for every request.

The table is a list of (largest batch size, k) rows in increasing batch size; a batch larger than
the last row gets k = 0. The default fits this project's CPU (docs/design.md §7): a step of a few
query tokens costs little more than one, and past that each token adds to it (measured:
reports/README.md#planner-measurements); so speculate deeply only while B * (1 + k) stays small,
and stop once the plain batch is itself compute-heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.policy import PolicyState

DEFAULT_TABLE: tuple[tuple[int, int], ...] = ((1, 6), (2, 4), (4, 3), (8, 2), (16, 1))


@dataclass(frozen=True)
class BatchTablePolicy:
    table: tuple[tuple[int, int], ...] = DEFAULT_TABLE
    requires: ClassVar[frozenset[str]] = frozenset()
    # A request with no draft found runs none, whatever k it is given: counting it is enough (Policy.choose).
    counts_idle_requests: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("a batch table needs at least one row")
        prev = 0
        for upto, k in self.table:
            if upto <= prev:
                raise ValueError(f"batch table rows must have increasing batch sizes >= 1, got {self.table}")
            if k < 0:
                raise ValueError(f"batch table k must be >= 0, got {k} for batch sizes up to {upto}")
            prev = upto

    @property
    def name(self) -> str:
        rows = ",".join(f"{upto}={k}" for upto, k in self.table)
        return "batch_table" if self.table == DEFAULT_TABLE else f"batch_table:{rows}"

    def k_for(self, batch_size: int) -> int:
        for upto, k in self.table:
            if batch_size <= upto:
                return k
        return 0

    def choose(self, state: PolicyState) -> list[int]:
        return state.capped(self.k_for(state.batch_size))


def parse_table(text: str) -> tuple[tuple[int, int], ...]:
    """``"2=4,8=2,16=1"`` -> ((2, 4), (8, 2), (16, 1)): up to B=2 k=4, up to 8 k=2, up to 16 k=1, then 0."""
    rows = []
    for part in text.split(","):
        upto, sep, k = part.strip().partition("=")
        if not sep:
            raise ValueError(f"batch table row {part.strip()!r} is not MAX_BATCH=K (e.g. '8=2')")
        try:
            rows.append((int(upto), int(k)))
        except ValueError:
            raise ValueError(f"batch table row {part.strip()!r} needs integers, e.g. '8=2'") from None
    return tuple(rows)
