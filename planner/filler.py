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
    """A constructor for the frozen dataclass ``cls`` taking every field, in order (no defaults),
    that fills the new instance's ``__dict__`` from one dict display. The function is generated,
    as dataclasses generates ``__init__``: a dict display of named arguments is a third faster
    than zipping names with a tuple."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__; build it normally")
    names = tuple(f.name for f in dataclasses.fields(cls))
    # Worked example, fields (seq_id, k): "def make(seq_id, k):\n    obj = new(cls)\n
    # obj.__dict__.update({'seq_id': seq_id, 'k': k})\n    return obj"
    source = (f"def make({', '.join(names)}):\n    obj = new(cls)\n"
              f"    obj.__dict__.update({{{', '.join(f'{n!r}: {n}' for n in names)}}})\n    return obj\n")
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    exec(source, scope)  # noqa: S102 - field names of a dataclass are identifiers
    make = scope["make"]
    make.__qualname__ = f"filler({cls.__name__})"
    return make
