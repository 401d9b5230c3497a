"""The deciders a sweep serves: a policy spec made into a decider (``make_decider``), and
``KRecorder``, which passes that decider's choices through and tallies, per engine request, the
k the engine ran each step (the decider's choice after the engine's caps), the drafts proposed
and accepted; the sweep joins its tallies to the client's rows by response id.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from specplan.bench.sla import SLA


@dataclass
class KTally:
    """What one request ran: steps, their k, drafts proposed and accepted, tokens emitted."""

    steps: int = 0
    k_sum: int = 0
    k0_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    hist: dict = field(default_factory=dict)  # k -> steps

    def row_fields(self) -> dict:
        """The columns a sweep's request row gets from this tally."""
        return dict(spec_steps=self.steps, k_sum=self.k_sum, k0_steps=self.k0_steps, num_draft_tokens=self.proposed,
                    num_accepted_tokens=self.accepted, num_emitted_tokens=self.emitted,
                    mean_k=self.k_sum / self.steps if self.steps else math.nan,
                    acceptance_rate=self.accepted / self.proposed if self.proposed else math.nan,
                    k_hist=json.dumps({str(k): v for k, v in sorted(self.hist.items())}))


class KRecorder:
    """A SpecDecider wrapper: passes decisions through and tallies, per engine request id, the k
    the engine ran each step, drafts proposed and accepted; plus step counts for the level."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._lock = threading.Lock()
        self._by_rid: dict[str, KTally] = {}
        self.reset_steps()

    def reset_steps(self) -> None:
        self.num_steps = 0
        self.decode_seqs = 0
        self.step_s = 0.0

    def decide(self, view: Any) -> list[int]:
        return self.inner.decide(view)

    def observe(self, record: Any) -> None:
        with self._lock:
            self.num_steps += 1
            self.decode_seqs += len(record.requests)
            self.step_s += record.total_s
            for r in record.requests:
                t = self._by_rid.get(r.request_id)
                if t is None:
                    t = self._by_rid[r.request_id] = KTally()
                t.steps += 1
                t.k_sum += r.k
                t.k0_steps += r.k == 0
                t.proposed += r.num_proposed
                t.accepted += r.num_accepted
                t.emitted += r.num_emitted
                t.hist[r.k] = t.hist.get(r.k, 0) + 1
        self.inner.observe(record)

    def pop(self, request_id: str) -> KTally | None:
        with self._lock:
            return self._by_rid.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._by_rid.clear()
        self.reset_steps()

    def __getattr__(self, name: str) -> Any:  # predicted_step_s and anything else the server reads
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_decider(policy: str, *, proposer: str, profile: Any, sla: SLA, max_k: int,
                 beliefs: Any = None) -> tuple[Any, str]:
    """The decider a policy runs with, and a description: off / static:K are fixed deciders (no
    planner in the loop, as serving stacks run them); the rest are the planner with that policy,
    started from ``beliefs`` (a planner/beliefs.py BeliefStore) when given."""
    from specplan.engine import FixedDecider
    from specplan.planner import planner_from_profile
    from specplan.policies import OffPolicy, StaticPolicy, make_policy

    rule = make_policy(policy)
    if isinstance(rule, (OffPolicy, StaticPolicy)):
        k = rule.k if isinstance(rule, StaticPolicy) else 0
        return FixedDecider(k), f"FixedDecider(k={k})"
    if profile is None and rule.requires:
        raise ValueError(f"policy {policy!r} needs a latency profile (--profile)")
    sla_s = sla.itl_ms / 1000.0 if sla.itl_ms is not None else None
    planner = planner_from_profile(profile, rule, proposer=proposer, sla_itl_s=sla_s, max_k=max_k)
    if beliefs is not None:
        beliefs.load_into(planner)
    return planner, (f"Planner({policy}, profile latency model, sla_itl_s={sla_s})" if profile is not None
                     else f"Planner({policy}, no profile)")


def needs_profile(policies: Sequence[str]) -> bool:
    """Whether any of these policies needs a latency profile to decide."""
    from specplan.policies import make_policy

    return any(make_policy(p).requires for p in policies)


__all__ = ["KTally", "KRecorder", "make_decider", "needs_profile"]
