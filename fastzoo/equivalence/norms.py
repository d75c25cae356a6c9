"""Every normalisation of fastzoo's model against the original's module of the same name (module
names are the checkpoint's) on inputs whose variance is comparable to its eps: the rows of a
tensor of standard deviation 1e-3, 1e-2 and 1. A model's own activations rarely reach a
normalisation with a variance near eps (a post-norm block's LayerNorm reads a residual sum of O(1)),
so an eps of 1e-6 for 1e-5 moves its outputs by ~4.5e-6 / var there, below fp32's bound; here it
moves them by ~50 %. Run by :func:`fastzoo.equivalence.check` as one comparison row, naming the
module that is furthest from its bound."""
from __future__ import annotations

import copy

import torch
from torch import nn

from fastzoo.equivalence.rule import Comparison, compare_outputs
from fastzoo.layers.norm import ChannelsFirstLayerNorm, RMSNorm

PROBE_STDS = (1e-3, 1e-2, 1.0)  # variances 1e-6, 1e-4, 1: around the usual eps (1e-6, 1e-5) and far above it
ROWS_PER_STD = 4
_CHANNEL_FIRST = (nn.modules.batchnorm._NormBase, nn.GroupNorm, ChannelsFirstLayerNorm)  # [N, C, ...] inputs
_NORMS = (nn.LayerNorm, nn.RMSNorm, RMSNorm, *_CHANNEL_FIRST)


def is_normalisation(module: nn.Module) -> bool:
    """A LayerNorm, RMSNorm, GroupNorm or BatchNorm (a frozen BatchNorm too: statistics as buffers)."""
    return isinstance(module, _NORMS) or (hasattr(module, "running_var") and hasattr(module, "weight"))


def _probe_input(module: nn.Module, gen: torch.Generator) -> torch.Tensor:
    """``ROWS_PER_STD`` rows per standard deviation of ``PROBE_STDS``, in the module's layout: [N, C, 2, 2]
    for a channel-first normalisation, [N, *normalized_shape] for the others."""
    n = len(PROBE_STDS) * ROWS_PER_STD
    std = torch.tensor(PROBE_STDS).repeat_interleave(ROWS_PER_STD)
    if isinstance(module, _CHANNEL_FIRST) or hasattr(module, "running_var"):
        channels = (module.num_channels if isinstance(module, nn.GroupNorm) else module.normalized_shape[0]
                    if isinstance(module, ChannelsFirstLayerNorm) else module.running_var.shape[0])
        return torch.randn(n, channels, 2, 2, generator=gen) * std.reshape(-1, 1, 1, 1)
    shape = tuple(getattr(module, "normalized_shape", None) or module.weight.shape)
    return torch.randn(n, *shape, generator=gen) * std.reshape(-1, *(1,) * len(shape))


def compare_norms(model: nn.Module, original: nn.Module, *, dtype: torch.dtype = torch.float32, device="cpu",
                  seed: int = 0, notes: list[str] | None = None) -> Comparison | None:
    """Each normalisation of ``model`` (run in ``dtype``) against ``original``'s same-named module (fp32)
    on the probe inputs, by the output rule (in a low precision: against the original's module in
    ``dtype`` as the peer). One comparison: the module furthest from its bound, named in ``worst``.
    None where ``model`` has no normalisation the original names; a normalisation it does not name is
    said in ``notes``."""
    theirs = dict(original.named_modules())
    gen = torch.Generator().manual_seed(seed + 3)
    low = dtype != torch.float32
    worst, unmatched = None, []
    for name, mod in model.named_modules():
        if not is_normalisation(mod):
            continue
        if name not in theirs:
            unmatched.append(name)
            continue
        ref_mod = theirs[name]
        x = _probe_input(mod, gen).to(device=device, dtype=dtype)
        with torch.no_grad():
            ref = ref_mod(x.float()).float()
            out = mod(x).float()
            peer = copy.deepcopy(ref_mod).to(dtype)(x).float() if low else None
        c = compare_outputs("normalisations at variance ~eps", out, ref, peer)
        if worst is None or not c.err / c.bound <= worst.err / worst.bound:
            worst = c
            worst.worst = name
    if unmatched and notes is not None:
        notes.append(f"normalisations not probed (no module of that name in the original): {', '.join(unmatched[:4])}"
                     + (f" and {len(unmatched) - 4} more" if len(unmatched) > 4 else ""))
    return worst
