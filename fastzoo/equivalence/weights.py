"""The weights every comparison is made on: a full random state drawn into a model (the original, before
fastzoo's model is built from it), so that every learned number moves the outputs.

A library's init hides bugs: zero biases make a dropped bias invisible, unit norm weights a swapped
norm, 0.02-scaled matrices near-uniform attention (a wrong attention scale or mask barely moves it),
BatchNorm statistics of 0 / 1 a mean read as a variance, a LayerScale of 1e-5 a whole branch.
:func:`draw_` replaces every learned floating parameter and buffer:

- matrices (Linear, transformers' ``Conv1D``, an embedding tied to the output layer):
  ``N(0, MATRIX_GAIN^2 / fan_in)``, so a layer's output is O(1) per unit input and attention scores
  q.k/sqrt(d) have a spread of about ``MATRIX_GAIN^2``: attention far from uniform, far from one-hot;
- convolutions: ``N(0, CONV_GAIN^2 / fan_in)``: a ResNet's eval-mode BatchNorm does not rescale what
  grows block by block (its statistics are drawn, not measured), so the gain is lower than 1: the
  logits' spread, 64 x 64 images: 1.2 (ResNet-18), 1.6 (ResNet-50), 3.6 (ResNet-101); at gain 1.0:
  2.8, 4.3, 27; at 1.2: 10, 60, 4300 (one-hot softmax);
- an untied embedding's rows (tokens, DETR's object queries): ``N(0, EMBED_STD^2)``, O(1) per
  component as a matrix's output;
- then rows scaled by a log-uniform factor in ``[SMALL_ROW_LOW, 1]``: every row of a learned
  token tensor (class token, position embedding), a quarter of the rows of an embedding (tied too): the first norm of a token whose rows are small reads
  a variance down to ~1e-5, where a norm eps of 1e-5 or 1e-6 moves its output by percents (at a
  variance of 1 by 4.5e-6, below fp32's bound: an eps bug would pass);
- biases (of anything, norms included): ``N(0, BIAS_STD^2)``;
- gains (norm weights, LayerScale's gamma, any other learned 1-D vector): ``1 + N(0, GAIN_STD^2)``
  as the module applies it: a "1 + w" norm (Gemma's RMSNorm, found by probing the module, not by
  its name) gets ``w ~ N(0, GAIN_STD^2)``;
- BatchNorm statistics (also frozen BatchNorm's buffers): mean ``N(0, BIAS_STD^2)``, variance
  log-uniform in ``[VAR_LOW, VAR_HIGH]`` (checkpoints hold variances down to 1e-4 and below, where
  eps matters), and the weight times ``sqrt(variance)``, so each channel's scale
  ``weight / sqrt(var)`` is a gain ``1 + N(0, GAIN_STD^2)``: outputs stay O(1) per unit input;
- other learned tensors (class / register tokens, position embeddings, latent queries):
  ``N(0, TOKEN_STD^2)``.

Computed buffers (rotary ``inv_freq``, causal masks, position ids, an embedding's scale) and integer
tensors are left as they are. Each tensor is drawn from its own generator seeded by ``seed`` and its
name, so the draw is deterministic, independent of the order modules are visited, and the same for a
module drawn twice. ``tests/test_weight_draw.py`` measures on each family's original that attention is
far from uniform and that nothing saturates.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

MATRIX_GAIN = 1.75  # output std per unit input of every matrix; attention scores spread ~MATRIX_GAIN^2
CONV_GAIN = 0.85  # convolutions: a ReLU net's activations grow slowly enough with depth (see below)
BIAS_STD = 0.2
GAIN_STD = 0.2
TOKEN_STD = 0.5
EMBED_STD = 1.0  # an untied embedding's rows: O(1) per component, as a matrix's output
VAR_LOW, VAR_HIGH = 1e-4, 1.0  # BatchNorm running_var, log-uniform: eps matters on the small ones
SMALL_ROWS, SMALL_ROW_LOW = 0.25, 1e-2  # rows scaled by 1e-2..1: a quarter of an embedding's, every token's


def describe(seed: int = 0) -> str:
    """The draw, named for reports (a check's Result, a fuzz row, the tour's JSON)."""
    return (f"fastzoo.equivalence.weights.draw_(seed={seed}): matrices N(0, {MATRIX_GAIN:g}^2/fan_in), "
            f"convolutions N(0, {CONV_GAIN:g}^2/fan_in), embeddings N(0, {EMBED_STD:g}^2), biases N(0, {BIAS_STD:g}^2), "
            f"gains 1+N(0, {GAIN_STD:g}^2), BN mean N(0, {BIAS_STD:g}^2) var log-U({VAR_LOW:g}, {VAR_HIGH:g}) "
            f"weight x sqrt(var), tokens N(0, {TOKEN_STD:g}^2); rows x log-U({SMALL_ROW_LOW:g}, 1): every token row, "
            f"{SMALL_ROWS:g} of embedding rows")


def draw_(module: nn.Module, *, seed: int = 0) -> nn.Module:
    """Draw a full random state into ``module`` in place (see the module docstring); returns it."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    # a tied embedding is the output layer's matrix too (GPT-2's wte): drawn as a matrix, once
    projections = {id(m.weight) for m in module.modules() if _is_matrix(m, "weight", getattr(m, "weight", None))
                   and not isinstance(m, nn.Embedding)}
    seen = set()
    with torch.no_grad():
        for prefix, m in module.named_modules():
            offset = _gain_offset(m)
            for name, t in _learned(m):
                if id(t) in seen or t.is_meta or not t.is_floating_point() or t.numel() == 0:
                    continue  # an empty tensor (a layer of width 0) has nothing to draw
                seen.add(id(t))
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{prefix}.{name}".encode()))
                t.copy_(_value(m, name, t, offset, g, tied=id(t) in projections))
                if isinstance(m, nn.Embedding) or (t.ndim >= 2 and not _is_matrix(m, name, t)):
                    t.mul_(_row_scales(t, g, every=not isinstance(m, nn.Embedding)))
            _scale_by_variance(m)
    return module


def _row_scales(t: torch.Tensor, g: torch.Generator, *, every: bool) -> torch.Tensor:
    """A factor per row (every index but the last), log-uniform in [SMALL_ROW_LOW, 1]: for ``every``
    row (a class token is one row), or else for a fraction SMALL_ROWS of them and 1 for the rest (an
    embedding: the other rows keep tokens apart, and attention sharp), so that a norm reading a sum
    of small rows sees a variance down to ~1e-5, where an eps of 1e-5 or 1e-6 differs by percents."""
    u = torch.rand((*t.shape[:-1], 1), generator=g)
    if every:
        return SMALL_ROW_LOW ** u
    return torch.where(u < SMALL_ROWS, SMALL_ROW_LOW ** (u / SMALL_ROWS), torch.ones_like(u))


def _scale_by_variance(m: nn.Module) -> None:
    """A BatchNorm's weight times sqrt(running_var): its output stays O(1) per unit input whatever the
    drawn variance, and eps moves it by ~eps / (2 var) on the small-variance channels."""
    var, weight = getattr(m, "running_var", None), getattr(m, "weight", None)
    if _is_norm(m) and isinstance(var, torch.Tensor) and isinstance(weight, torch.Tensor) and var.is_floating_point():
        weight.mul_(var.sqrt())


def _is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower()


def _learned(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``m``'s own parameters, and the buffers that are learned state: a norm's (BatchNorm statistics,
    frozen BatchNorm's weight and bias); every other buffer is computed."""
    tensors = list(m.named_parameters(recurse=False))
    if _is_norm(m):
        tensors += [(n, b) for n, b in m.named_buffers(recurse=False)
                    if n in ("weight", "bias", "running_mean", "running_var")]
    return tensors


def _is_matrix(m: nn.Module, name: str, t) -> bool:
    return name == "weight" and isinstance(t, torch.Tensor) and t.ndim >= 2 and not _is_norm(m)


def _fan_in(m: nn.Module, t: torch.Tensor) -> int:
    if type(m).__name__ == "Conv1D":  # transformers' GPT-2 layer: weight [in, out]
        return t.shape[0]
    return t[0].numel()  # Linear [out, in], Conv [out, in / groups, *kernel], Embedding [num, dim]


def _value(m: nn.Module, name: str, t: torch.Tensor, offset: float, g: torch.Generator, *, tied: bool) -> torch.Tensor:
    r = torch.randn(t.shape, generator=g)
    if name == "running_var":
        return VAR_LOW * (VAR_HIGH / VAR_LOW) ** torch.rand(t.shape, generator=g)
    if name in ("bias", "running_mean"):
        return BIAS_STD * r
    if isinstance(m, nn.Embedding) and not tied:  # a row is the output: O(1) per component
        return EMBED_STD * r
    if _is_matrix(m, name, t):
        return r * ((CONV_GAIN if t.ndim > 2 else MATRIX_GAIN) / _fan_in(m, t) ** 0.5)
    if t.ndim <= 1:  # a gain: norm weight, LayerScale gamma, a learned per-channel scale
        return 1 + GAIN_STD * r - offset
    return TOKEN_STD * r


def _gain_offset(m: nn.Module) -> float:
    """1.0 where the norm ``m`` scales by ``1 + weight`` (Gemma's RMSNorm), else 0: probed by running
    it with its weight (and bias) at zero, which gives zeros only where the weight multiplies."""
    weight = getattr(m, "weight", None)
    if not _is_norm(m) or not isinstance(weight, torch.Tensor) or weight.is_meta or "running_var" in dict(
            m.named_buffers(recurse=False)) or not weight.is_floating_point():
        return 0.0
    bias = getattr(m, "bias", None)
    saved = weight.detach().clone(), None if not isinstance(bias, torch.Tensor) else bias.detach().clone()
    try:
        weight.zero_()
        if saved[1] is not None:
            bias.zero_()
        x = torch.randn((2, *weight.shape), generator=torch.Generator().manual_seed(0)).to(weight)
        y = m(x)
        return 0.0 if isinstance(y, torch.Tensor) and y.abs().max().item() == 0 else 1.0
    except Exception:  # noqa: BLE001 -- a norm that cannot be probed on a plain tensor: applies its weight
        return 0.0
    finally:
        weight.copy_(saved[0])
        if saved[1] is not None:
            bias.copy_(saved[1])
