"""Closed loop on acceptance: do the drafts the policy chose emit what their estimates promised?

Each request's posterior is fair over all of its steps, but the policy does not draft on all of
them: it drafts for the requests, and on the steps, whose estimates look best, and an estimate
that looks best is more often too high than too low (the winner's curse of choosing on noisy
numbers). So the drafted requests accept fewer drafts than their estimates expected, enough to
wipe out a small predicted gain (measured: reports/README.md#planner-measurements).
No single request's posterior can see this; the planner can, by comparing over every drafted
request-step the accepted drafts with the expected ones, and scaling what each draft is expected to
yield by that ratio (``factor``) before the policy chooses (the planner passes it to each request's
estimate: planner/acceptance.py ``RequestAcceptance.estimate``).

Worked example: the chosen drafts of the last steps were expected to yield 40 tokens and 32 were
accepted. With the prior of 8 expected tokens at ratio 1, factor = (8 + 32) / (8 + 40) = 0.83, so
a first draft the request's posterior prices at 0.6 is valued at 0.5 (and each later one in
proportion: the factor scales ``alpha_first``, which scales every draft's gain).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationConfig:
    discount: float = 0.99  # per drafted request-step: about the last 100 of them
    prior_tokens: float = 8.0  # pseudo-evidence at ratio 1, in expected tokens
    min_factor: float = 0.5
    max_factor: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {self.discount}")
        if self.prior_tokens <= 0:
            raise ValueError(f"prior_tokens must be > 0, got {self.prior_tokens}")
        if not 0.0 < self.min_factor <= 1.0 <= self.max_factor:
            raise ValueError("need 0 < min_factor <= 1 <= max_factor")


class AcceptanceCalibration:
    """accepted / expected over the drafts the policy chose (discounted, prior-weighted)."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig()):
        self.config = config
        self.expected = 0.0  # discounted expected accepted drafts, by the uncalibrated estimates
        self.accepted = 0.0  # discounted accepted drafts of the same request-steps
        self.factor = 1.0

    def observe(self, expected: float, accepted: int) -> None:
        """One drafted request-step: what its uncalibrated estimate expected, what was accepted."""
        cfg = self.config
        self.expected = self.expected * cfg.discount + expected
        self.accepted = self.accepted * cfg.discount + accepted
        ratio = (cfg.prior_tokens + self.accepted) / (cfg.prior_tokens + self.expected)
        self.factor = max(cfg.min_factor, min(cfg.max_factor, ratio))

    def state(self) -> dict:
        return {"expected": self.expected, "accepted": self.accepted}

    def load_state(self, state: dict, max_expected: float) -> None:
        """A saved ratio, weighed as at most ``max_expected`` expected tokens of evidence."""
        expected, accepted = float(state["expected"]), float(state["accepted"])
        scale = min(1.0, max_expected / expected) if expected > 0 else 0.0
        self.expected, self.accepted = expected * scale, accepted * scale
        cfg = self.config
        ratio = (cfg.prior_tokens + self.accepted) / (cfg.prior_tokens + self.expected)
        self.factor = max(cfg.min_factor, min(cfg.max_factor, ratio))
