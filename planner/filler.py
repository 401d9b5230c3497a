"""``filler``: a fast positional constructor for frozen dataclasses built per request per step.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (the
price of frozen). The planner builds a ``RequestState`` per request every step, and the vLLM
plugin a ``RequestView`` and a ``RequestRecord`` too: at B = 32 those constructors were ~0.1 ms a
step each, measured, of the plugin's 1 ms budget (scripts/vllm_plugin_cost.py). The objects are
the types' own, equal to ones built normally; only ``__post_init__`` would be skipped, so a type
that has one is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def filler(cls: type) -> Callable[..., Any]:
    """A constructor for the frozen dataclass ``cls`` taking every field, in order, positionally
    (no defaults), that fills the new instance's ``__dict__`` at once."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__; build it normally")
    names = tuple(f.name for f in dataclasses.fields(cls))
    new = object.__new__

    def make(*values: Any) -> Any:
        if len(values) != len(names):
            raise TypeError(f"{cls.__name__} takes {len(names)} fields ({', '.join(names)}), got {len(values)}")
        obj = new(cls)
        obj.__dict__.update(zip(names, values))
        return obj

    return make
