"""SLA metrics of a sweep: the targets (``SLA``) and pure functions from one request's chunk
arrival times to a level's summary. No I/O, no server.

Metric definitions (those of vLLM's serving benchmark, ``benchmark_serving.py``):

- A *chunk* is one SSE event that carries ``choices`` (the final usage-only event does not). The
  engine may put several tokens in one chunk when speculation accepts drafts.
- TTFT: first chunk's arrival − the request's send time.
- ITL: the gaps between successive chunks of a request (so with speculation one gap may deliver
  several tokens); level percentiles are over all gaps of all successful requests.
- E2EL: the last chunk's arrival − the send time.
- TPOT: (E2EL − TTFT) / (output_tokens − 1), output tokens from the response's ``usage``; only
  requests with more than one output token enter the TPOT statistics (for goodput a one-token
  request has TPOT 0, as in vLLM).
- Request throughput: successful requests / level duration; output token throughput: their output
  tokens / level duration; the level duration runs from the first send to the last completion
  (or cancellation).
- Goodput (vLLM's ``--goodput``): successful requests meeting every SLA threshold given — TTFT ≤
  ``sla.ttft_ms``, TPOT ≤ ``sla.tpot_ms`` (default: the ITL target), E2EL ≤ ``sla.e2el_ms`` — per
  second of level duration.
- Percentiles use ``numpy.percentile`` (linear interpolation); all latencies are reported in ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLA:
    """Latency targets in milliseconds (None: no target)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # per chunk gap: the sweep's "p90 ITL meets the SLA" test
    tpot_ms: float | None = None  # per-request goodput threshold on TPOT; None: itl_ms
    e2el_ms: float | None = None

    def goodput_thresholds(self) -> dict[str, float]:
        """vLLM's ``--goodput`` dictionary: metric -> threshold in ms."""
        out = {}
        tpot = self.tpot_ms if self.tpot_ms is not None else self.itl_ms
        for name, value in (("ttft", self.ttft_ms), ("tpot", tpot), ("e2el", self.e2el_ms)):
            if value is not None:
                out[name] = float(value)
        return out


def request_timings(start: float, chunk_times: Sequence[float], output_tokens: int | None) -> dict:
    """TTFT, ITL gaps, E2EL and TPOT in seconds from the send time and the chunks' arrival times."""
    if not chunk_times:
        return {"ttft_s": math.nan, "itl_s": [], "e2el_s": math.nan, "tpot_s": math.nan}
    ttft = chunk_times[0] - start
    e2el = chunk_times[-1] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    n = output_tokens or 0
    tpot = (e2el - ttft) / (n - 1) if n > 1 else math.nan
    return {"ttft_s": ttft, "itl_s": itl, "e2el_s": e2el, "tpot_s": tpot}


def is_good(row: dict, sla: SLA) -> bool:
    """vLLM's goodput test for one successful request (a one-token request has TPOT 0)."""
    if not row.get("success"):
        return False
    thresholds = sla.goodput_thresholds()
    values = {"ttft": row["ttft_s"], "e2el": row["e2el_s"],
              "tpot": 0.0 if (row.get("output_tokens") or 0) <= 1 else row["tpot_s"]}
    return all(values[k] * 1000.0 <= v for k, v in thresholds.items())


def latency_stats(values: Iterable[float], name: str) -> dict:
    """Mean, median, std and PERCENTILES of latencies given in seconds, as ``<stat>_<name>_ms``."""
    import numpy as np

    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)  # as vLLM: `np.mean(x or 0)` when nothing was measured
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize_level(rows: Sequence[dict], duration_s: float, sla: SLA) -> dict:
    """vLLM's ``calculate_metrics`` over one level's request rows, plus speculation counters."""
    ok = [r for r in rows if r.get("success")]
    outputs = [int(r.get("output_tokens") or 0) for r in ok]
    total_input = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    dur = max(duration_s, 1e-9)
    good = sum(is_good(r, sla) for r in ok)
    out = {
        "num_requests": len(rows), "completed": len(ok), "failed": len(rows) - len(ok),
        "duration_s": duration_s, "total_input": total_input, "total_output": sum(outputs),
        "request_throughput": len(ok) / dur, "request_goodput": good / dur,
        "output_throughput": sum(outputs) / dur, "total_token_throughput": (total_input + sum(outputs)) / dur,
        "good_fraction": good / len(rows) if rows else 0.0,
    }
    out.update(latency_stats((r["ttft_s"] for r in ok), "ttft"))
    out.update(latency_stats((r["tpot_s"] for r, n in zip(ok, outputs) if n > 1), "tpot"))
    out.update(latency_stats((g for r in ok for g in (r.get("itl_s") if r.get("itl_s") is not None else [])), "itl"))
    out.update(latency_stats((r["e2el_s"] for r in ok), "e2el"))
    steps = sum(int(r.get("spec_steps") or 0) for r in ok)
    k_sum = sum(int(r.get("k_sum") or 0) for r in ok)
    proposed = sum(int(r.get("num_draft_tokens") or 0) for r in ok)
    accepted = sum(int(r.get("num_accepted_tokens") or 0) for r in ok)
    k0 = sum(int(r.get("k0_steps") or 0) for r in ok)
    out.update({"spec_steps": steps, "mean_k": k_sum / steps if steps else math.nan,
                "k0_share": k0 / steps if steps else math.nan, "num_draft_tokens": proposed,
                "num_accepted_tokens": accepted, "acceptance_rate": accepted / proposed if proposed else 0.0})
    return out


def meets_itl_sla(level: dict, sla: SLA) -> bool:
    """A level meets the ITL SLA when its p90 ITL is within the target and no request failed."""
    if sla.itl_ms is None:
        return level.get("failed", 0) == 0
    return level.get("failed", 0) == 0 and level.get("completed", 0) > 0 and level["p90_itl_ms"] <= sla.itl_ms


def max_load_meeting(loads: Sequence[float], passes: Sequence[bool]) -> float | None:
    """The highest load such that it and every lower load pass (None if the lowest fails)."""
    best = None
    for load, ok in sorted(zip(loads, passes), key=lambda x: x[0]):
        if not ok:
            break
        best = load
    return best


__all__ = ["SLA", "request_timings", "is_good", "latency_stats", "summarize_level", "meets_itl_sla",
           "max_load_meeting", "PERCENTILES"]
