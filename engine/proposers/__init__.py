"""Proposers, one per file, behind one interface (``base.Proposer``); ``factory`` builds them."""

from ..drafts import DraftTokens, DraftTree
from .base import Proposer

__all__ = ["DraftTokens", "DraftTree", "Proposer"]
