"""Speculative decoding inside an engine step: planning (speculator.py: ask the decider for k,
reserve lookahead slots, propose) and verification (verifier.py over the pure rules in
rejection_sampler.py, with Triton kernels of the same signatures for CUDA)."""

from .speculator import Proposal, Speculator
from .verifier import Verdict, verify

__all__ = ["Proposal", "Speculator", "Verdict", "verify"]
