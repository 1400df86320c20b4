"""Sampling policy: turn a step's logits into the next token."""

from .sampler import RequestRNG, sample

__all__ = ["RequestRNG", "sample"]
