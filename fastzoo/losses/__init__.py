"""Losses with a reference definition and, where it pays, faster implementations."""
from fastzoo.losses.lm import causal_lm_loss

__all__ = ["causal_lm_loss"]
