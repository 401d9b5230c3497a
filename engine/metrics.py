"""Speculation counters, per request and for the whole engine (vLLM's spec_decode_* names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .decider import RequestRecord, StepRecord


@dataclass
class SpecCounters:
    """Counts over verification events; the same class serves one request and the whole engine."""

    num_drafts: int = 0  # verification events that had at least one draft token
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    num_emitted_tokens: int = 0  # tokens emitted by decode steps (accepted + bonus/recovered)
    num_decode_steps: int = 0  # decode verification events, with or without drafts
    accepted_per_position: list[int] = field(default_factory=list)  # position j accepted, over events
    drafted_per_position: list[int] = field(default_factory=list)  # position j proposed, over events

    def add(self, r: RequestRecord) -> None:
        self.num_decode_steps += 1
        self.num_emitted_tokens += r.num_emitted
        if r.num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += r.num_proposed
        self.num_accepted_tokens += r.num_accepted
        grow = r.num_proposed - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(r.num_proposed):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < r.num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification event with drafts, the bonus/recovered token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
        }


class SpecStats(SpecCounters):
    """Engine-wide counters plus step counts."""

    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0
        # k in effect (RequestRecord.k_in_effect: under a stop rule, the drafts run) -> request-steps
        self.k_histogram: dict[int, int] = {}
        self.decider_s = 0.0  # wall time inside the decider's decide() and observe(), all steps

    @property
    def decider_ms_per_step(self) -> float:
        """What choosing k costs a step (a planner's whole per-step bookkeeping)."""
        return 1000.0 * self.decider_s / self.num_steps if self.num_steps else 0.0

    def add(self, record: StepRecord) -> None:  # type: ignore[override]
        self.num_steps += 1
        for r in record.requests:
            SpecCounters.add(self, r)
            k = r.k_in_effect
            self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
