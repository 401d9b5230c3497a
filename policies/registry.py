"""``make_policy("static:4")``: policies by name, as the CLI and reports spell them.

A spec is ``NAME`` or ``NAME:ARG``. Keyword options reach constructors that need more than a
string can carry (the oracle's measured table).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

from ..planner.policy import Policy
from .batch_table import BatchTablePolicy, parse_table
from .goodput import GoodputPolicy
from .heuristic import HeuristicPolicy
from .off import OffPolicy
from .oracle import OraclePolicy
from .roofline import RooflinePolicy
from .static import StaticPolicy


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"policy {name!r} takes no argument, got {name}:{arg}")


def _int_arg(name: str, arg: str | None, default: int | None, example: str) -> int:
    if arg is None:
        if default is None:
            raise ValueError(f"policy {name!r} needs a k, e.g. {example!r}")
        return default
    try:
        value = int(arg)
    except ValueError:
        raise ValueError(f"policy {name!r} needs an integer k >= 0, got {arg!r} (e.g. {example!r})") from None
    if value < 0:
        raise ValueError(f"policy {name!r} needs an integer k >= 0, got {value} (e.g. {example!r})")
    return value


def _off(arg: str | None, **_: Any) -> Policy:
    _no_arg("off", arg)
    return OffPolicy()


def _static(arg: str | None, **_: Any) -> Policy:
    return StaticPolicy(_int_arg("static", arg, None, "static:4"))


def _batch_table(arg: str | None, **_: Any) -> Policy:
    return BatchTablePolicy() if arg is None else BatchTablePolicy(parse_table(arg))


def _heuristic(arg: str | None, **_: Any) -> Policy:
    k = _int_arg("heuristic", arg, 4, "heuristic:4")
    if k < 1:
        raise ValueError("policy 'heuristic' starts at k >= 1 (it never goes below 1), e.g. 'heuristic:4'")
    return HeuristicPolicy(start_k=k)


def _roofline(arg: str | None, **_: Any) -> Policy:
    return RooflinePolicy(_int_arg("roofline", arg, 4, "roofline:4"))


def _goodput(arg: str | None, **_: Any) -> Policy:
    """``goodput``, ``goodput:MARGIN``, ``goodput:stop`` (a draft head's confidence stop on), or
    ``goodput:MARGIN+stop``."""
    if arg is None:
        return GoodputPolicy()
    margin, plus, stop = arg.partition("+")
    if margin == "stop" and not plus:
        return GoodputPolicy(confidence_stop=True)
    try:
        if plus and stop != "stop":
            raise ValueError(stop)
        return GoodputPolicy(min_relative_gain=float(margin), confidence_stop=bool(plus))
    except ValueError:
        raise ValueError(f"policy 'goodput' takes an optional margin >= 0 and/or 'stop' (e.g. 'goodput:0.02', "
                         f"'goodput:stop', 'goodput:0.02+stop'), got {arg!r}") from None


def _oracle(arg: str | None, *, oracle_table=None, oracle_cell=None, **_: Any) -> Policy:
    _no_arg("oracle", arg)
    if oracle_table is None:
        raise ValueError("policy 'oracle' needs measured goodput per static k per cell: "
                         "make_policy('oracle', oracle_table={cell: {k: goodput}})")
    return OraclePolicy(oracle_table, oracle_cell)


POLICIES: Mapping[str, Callable[..., Policy]] = MappingProxyType({
    "off": _off,
    "static": _static,
    "batch_table": _batch_table,
    "heuristic": _heuristic,
    "roofline": _roofline,
    "goodput": _goodput,
    "oracle": _oracle,
})

_OPTIONS = frozenset({"oracle_table", "oracle_cell"})


def make_policy(spec: str, **options: Any) -> Policy:
    """A policy from ``NAME[:ARG]``: off, static:K, batch_table[:B=K,...], heuristic[:K],
    roofline[:K], goodput[:MARGIN][+stop] or goodput:stop, oracle (with ``oracle_table=`` and optionally ``oracle_cell=``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy name is required; choose one of: {', '.join(POLICIES)}")
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown policy option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    name, sep, arg = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise ValueError(f"unknown policy {spec!r}; choose one of: {', '.join(POLICIES)}")
    if sep and not arg.strip():
        raise ValueError(f"policy spec {spec!r} has an empty argument after ':'")
    return POLICIES[name](arg.strip() if sep else None, **options)
