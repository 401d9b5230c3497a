"""Proposers, one per file, behind one interface (``base.Proposer``); ``factory`` builds them."""

from .base import DraftTokens, DraftTree, Proposer

__all__ = ["DraftTokens", "DraftTree", "Proposer"]
