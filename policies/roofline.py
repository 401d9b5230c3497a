"""``roofline``: speculate with a fixed k while the step stays memory-bound, off past the ridge.

Arithmetic intensity (FLOP per byte moved) of the step *as it would run with k drafts each* is
compared with the machine's ridge point (peak FLOP/s / bandwidth), both read through the planner's
``Roofline`` interface (profiler/roofline.py ``LinearRoofline`` from a profile). Below the ridge the
extra verify tokens ride along on the weight reads almost for free; past it they cost compute
time. It ignores acceptance and the measured latency (on a CPU small-row matrix products sit far
from either ceiling), which is why the goodput policy exists; it is the textbook baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.policy import PolicyState


@dataclass(frozen=True)
class RooflinePolicy:
    k: int = 4
    requires: ClassVar[frozenset[str]] = frozenset({"roofline"})
    # A request with no draft found runs none, whatever k it is given: counting it is enough (Policy.choose).
    counts_idle_requests: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"roofline k must be >= 0, got {self.k}")

    @property
    def name(self) -> str:
        return "roofline" if self.k == 4 else f"roofline:{self.k}"

    def choose(self, state: PolicyState) -> list[int]:
        if state.roofline is None:
            raise ValueError("the roofline policy needs the step's arithmetic intensity: "
                             "give the planner a roofline (e.g. Profile.roofline(), a LinearRoofline)")
        ks = state.capped(self.k)
        if state.roofline.intensity(state.shape_with(sum(ks))) > state.roofline.ridge:
            return [0] * len(ks)
        return ks
