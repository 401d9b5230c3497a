"""Speculative decoding inside an engine step: planning (speculator.py: ask the decider for k,
reserve lookahead slots, propose) and verification (verifier.py over the pure rules in
rejection_sampler.py, with Triton kernels of the same signatures for CUDA).

Glossary (as in vLLM's spec-decode; the engine, proposers and planner use these words):
  draft tokens      the proposer's guesses for the next tokens of a request
  accepted tokens   the longest prefix of the drafts the target model agrees with
  bonus token       the target's own next token when every draft was accepted
  recovered token   the token sampled from the residual distribution after a rejection
  emitted tokens    what a step appends to a request: its accepted drafts, then one bonus or
                    recovered token (a request with no drafts emits just the bonus token)
  lookahead slots   KV slots reserved for the draft tokens before the verify forward pass
"""

from .speculator import Proposal, Speculator
from .verifier import Verdict, verify

__all__ = ["Proposal", "Speculator", "Verdict", "verify"]
