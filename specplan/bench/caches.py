"""``CacheSweep``: evict the CPU caches the way a forward pass does, for benchmarks of the
planner's and the plugin's own time (scripts/planner_step_cost.py, scripts/vllm_plugin_cost.py).

Between two planner calls the engine (or vLLM) streams ~100 MB of weights through the caches, so
the planner's code and objects come back from memory every step: its calls cost ~2x what they
cost hot. Reading a buffer larger than the last-level cache before each timed call reproduces it.
"""

from __future__ import annotations

import numpy as np


class CacheSweep:
    """``sweep()`` reads ``mib`` MiB (0: does nothing)."""

    def __init__(self, mib: int):
        if mib < 0:
            raise ValueError(f"mib must be >= 0, got {mib}")
        self._buffer = np.ones(mib * 2**20 // 8) if mib else None  # [MiB / 8 B] float64

    def sweep(self) -> None:
        if self._buffer is not None:
            self._buffer.sum()
