"""specplan.planner – acceptance estimation, the goodput model, allocation, and the online controller.

``Planner`` is loaded on first use: it imports ``specplan.policies``, whose modules import this
package's leaf modules (acceptance, goodput, allocate), so importing it eagerly here would make
the two packages' import order matter.
"""

from .acceptance import AcceptanceConfig, AcceptanceEstimate, PooledAcceptance, ProposerPrior, RequestAcceptance
from .allocate import Allocation, allocate
from .drift import DraftSlope, DraftSlopeConfig, DriftConfig, DriftCorrectedLatency, DriftCorrection
from .goodput import DraftCost, StepCostModel, expected_tokens, step_goodput
from .timing import StepTimingLearner, TimingConfig

__all__ = ["Planner", "AcceptanceConfig", "AcceptanceEstimate", "PooledAcceptance", "ProposerPrior",
           "RequestAcceptance", "Allocation", "allocate", "DraftSlope", "DraftSlopeConfig", "DriftConfig", "DriftCorrection",
           "DriftCorrectedLatency", "DraftCost", "StepCostModel", "expected_tokens", "step_goodput",
           "StepTimingLearner", "TimingConfig"]


def __getattr__(name: str):
    if name == "Planner":
        from .controller import Planner

        return Planner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
