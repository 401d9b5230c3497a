"""specplan.policies – decision rules, one file each, behind one interface (``Policy.choose``)."""

from .base import Outcome, Policy, PolicyState, RequestState, Roofline
from .batch_table import BatchTablePolicy
from .goodput import GoodputPolicy
from .heuristic import HeuristicPolicy
from .off import OffPolicy
from .oracle import OraclePolicy, best_static_k
from .registry import POLICIES, make_policy
from .roofline import LinearRoofline, RooflinePolicy
from .static import StaticPolicy

__all__ = ["Policy", "PolicyState", "RequestState", "Outcome", "Roofline", "make_policy", "POLICIES",
           "OffPolicy", "StaticPolicy", "BatchTablePolicy", "HeuristicPolicy", "RooflinePolicy",
           "LinearRoofline", "GoodputPolicy", "OraclePolicy", "best_static_k"]
