"""specplan.policies – decision rules, one file each, implementing the planner's interface
(specplan.planner ``Policy.choose(state)``); ``make_policy`` builds one from its ``NAME[:ARG]`` spec."""

from .batch_table import BatchTablePolicy
from .goodput import GoodputPolicy
from .heuristic import HeuristicPolicy
from .off import OffPolicy
from .oracle import OraclePolicy, best_static_k
from .registry import POLICIES, make_policy
from .roofline import RooflinePolicy
from .static import StaticPolicy

__all__ = ["make_policy", "POLICIES", "OffPolicy", "StaticPolicy", "BatchTablePolicy", "HeuristicPolicy",
           "RooflinePolicy", "GoodputPolicy", "OraclePolicy", "best_static_k"]
