"""Rotary position embeddings (Su et al. 2021, "RoFormer"), with the frequency schedules of
the long-context extensions that Llama-layout checkpoints use, computed as transformers
computes them (``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and ``dynamic_rope_update``):

- ``default``: ``inv_freq_i = theta^(-2i/d)``;
- ``linear`` (position interpolation, Chen et al. 2023): ``inv_freq / factor``;
- ``dynamic`` (NTK-aware, /u/bloc97 and /u/emozilla): theta grows with the longest position
  of the forward once it passes ``max_position_embeddings``;
- ``llama3`` (Llama 3.1): low frequencies divided by ``factor``, a smooth ramp between;
- ``yarn`` (Peng et al. 2023): interpolation / extrapolation ramp and an attention scale;
- ``longrope`` (Ding et al. 2024): per-frequency ``short_factor`` / ``long_factor`` chosen by
  the longest position of the forward, and an attention scale.

``cos`` and ``sin`` are computed in fp32 (autocast off) and multiplied by the schedule's
attention scale, then cast to the activations' dtype; q and k are rotated by halves
(``rotate_half``: the GPT-NeoX / HF layout, not interleaved pairs).

The frequencies depend only on the forward's positions: ``dynamic`` and ``longrope`` read
the longest position of each forward (one tensor op, no host read), where transformers keeps
the longest it has seen in module state. For one forward on a fresh model, and for
generation (positions only grow), the two agree.
"""
from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# fields each schedule needs in ``rope_parameters`` besides rope_type / rope_theta (transformers' validation)
REQUIRED = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def _exponents(dim: int, device=None) -> torch.Tensor:
    """``2i / dim`` for i < dim / 2, in fp32 (transformers' arange in int64, then float)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def inverse_frequencies(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2], attention_scaling)`` of a schedule whose frequencies are fixed
    (every type but ``dynamic``; ``longrope``: its short-context frequencies)."""
    kind, theta = rope.get("rope_type", "default"), float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** _exponents(dim))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(rope, theta, dim, max_positions)
    if kind == "longrope":
        return _longrope(rope, theta, dim, max_positions, long=False)
    raise ValueError(f"rope_type={kind!r}: one of {', '.join(ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)  # long waves: interpolate
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: dict, theta: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    factor = rope.get("factor")
    original = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength turns `rotations` times over the context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _exponents(dim)
    extrapolate = 1 - ramp  # high frequencies keep their values, low ones are interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attention_factor


def _longrope(rope: dict, theta: float, dim: int, max_positions: int, long: bool) -> tuple[torch.Tensor, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:
        factor = max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** _exponents(dim)), attention_factor


class RotaryEmbedding(nn.Module):
    """``cos, sin [b, s, dim]`` for the positions ``[b, s]`` of a forward, per ``rope``
    (transformers' ``rope_parameters``: ``rope_type``, ``rope_theta`` and the type's fields)."""

    def __init__(self, rope: dict, dim: int, max_positions: int):
        super().__init__()
        self.rope, self.dim, self.max_positions = dict(rope), dim, max_positions
        self.kind = self.rope.get("rope_type", "default")
        inv_freq, self.attention_scaling = inverse_frequencies(self.rope, dim, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.kind == "longrope":
            self.register_buffer("long_inv_freq", _longrope(self.rope, float(self.rope.get("rope_theta", 10000.0)), dim, max_positions, long=True)[0], persistent=False)

    def _frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` for this forward (``dynamic`` and ``longrope`` read the longest position)."""
        if positions.numel() == 0:
            return self.inv_freq
        if self.kind == "dynamic":
            seq_len = (positions.max() + 1).clamp(min=self.max_positions).float()
            factor, theta = self.rope["factor"], float(self.rope.get("rope_theta", 10000.0))
            base = theta * ((factor * seq_len / self.max_positions) - (factor - 1)) ** (self.dim / (self.dim - 2))
            return 1.0 / (base ** _exponents(self.dim, positions.device))
        if self.kind == "longrope":
            longer = positions.max() + 1 > self.rope["original_max_position_embeddings"]
            return torch.where(longer, self.long_inv_freq, self.inv_freq)
        return self.inv_freq

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(positions.device.type, enabled=False):
            inv_freq = self._frequencies(positions).float()
            angles = positions.float()[..., None] * inv_freq  # [b, s, dim/2]
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` by its position's angles (cos/sin broadcast over heads)."""
    cos, sin = cos_BSD[:, None], sin_BSD[:, None]
    return x_BHSD * cos + rotate_half(x_BHSD) * sin
