"""specplan.planner – acceptance estimation, the goodput model, the policy interface, and the online
controller. The decision rules live in specplan.policies, which imports this package (never the
other way round)."""

from .acceptance import AcceptanceConfig, AcceptanceEstimate, PooledAcceptance, ProposerPrior, RequestAcceptance
from .controller import Planner, PlannerConfig
from .drift import DraftSlope, DraftSlopeConfig, DriftConfig, DriftCorrectedLatency, DriftCorrection
from .from_profile import planner_from_profile
from .goodput import DraftCost, StepCostModel, expected_tokens, step_goodput
from .policy import Outcome, Policy, PolicyState, RequestState, Roofline, StepPricing
from .timing import StepTimingLearner, TimingConfig

__all__ = ["Planner", "PlannerConfig", "planner_from_profile", "Policy", "PolicyState", "RequestState", "Outcome",
           "Roofline", "StepPricing", "AcceptanceConfig", "AcceptanceEstimate", "PooledAcceptance", "ProposerPrior",
           "RequestAcceptance", "DraftSlope", "DraftSlopeConfig", "DriftConfig", "DriftCorrection",
           "DriftCorrectedLatency", "DraftCost", "StepCostModel", "expected_tokens", "step_goodput",
           "StepTimingLearner", "TimingConfig"]
