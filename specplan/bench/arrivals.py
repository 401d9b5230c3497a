"""What a sweep level sends, and when: a workload's prompts as token ids, the send times of an
arrival process, and the request list that pairs them.

Arrivals are a Poisson process at a given rate (gamma intervals with ``burstiness`` != 1,
``inf``: all at once); in concurrency mode the client ignores send times and runs a closed loop.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

from specplan.bench.workloads import load_workload


@dataclass(frozen=True)
class LoadRequest:
    index: int
    workload: str
    prompt_id: str
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    send_at: float = 0.0  # seconds after the level starts (rate mode)


@dataclass(frozen=True)
class RenderedPrompt:
    workload: str
    prompt_id: str
    token_ids: tuple[int, ...]


def render_workload(workload: str | Sequence[Any], tokenizer: Any, *, pool: int, seed: int,
                    max_input_tokens: int | None) -> list[RenderedPrompt]:
    """Prompts of a workload (name, or Prompt objects) as token ids (the chat template applied
    where the model has one), longer ones than ``max_input_tokens`` left out. Names go through
    ``load_workload``."""
    if isinstance(workload, str):
        prompts = load_workload(workload, pool, seed)
    else:
        prompts = list(workload)
    out = []
    for p in prompts:
        ids = p.render(tokenizer)
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            continue
        out.append(RenderedPrompt(p.workload, p.id, tuple(ids)))
    if not out:
        raise ValueError(f"no prompt of the workload fits in {max_input_tokens} input tokens "
                         f"(raise --max-input-tokens or the context length)")
    return out


def arrival_times(rate: float, *, duration_s: float | None = None, num_requests: int | None = None,
                  seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (s) of a Poisson process (gamma intervals when burstiness != 1), the first at 0,
    for ``duration_s`` seconds or ``num_requests`` requests. rate=inf: all at 0."""
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests (a duration sends nothing more after t=0)")
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    while True:
        if num_requests is not None and len(times) >= num_requests:
            return times
        if duration_s is not None and t >= duration_s:
            return times or [0.0]
        times.append(t)
        t += rng.gammavariate(burstiness, theta)


def make_requests(prompts: Sequence[RenderedPrompt], send_at: Sequence[float], max_tokens: int,
                  offset: int = 0) -> list[LoadRequest]:
    """One request per send time, cycling through the prompts from ``offset``."""
    return [LoadRequest(i, p.workload, p.prompt_id, p.token_ids, max_tokens, t)
            for i, t in enumerate(send_at) for p in [prompts[(offset + i) % len(prompts)]]]


__all__ = ["LoadRequest", "RenderedPrompt", "render_workload", "arrival_times", "make_requests"]
