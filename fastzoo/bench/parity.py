"""The benchmarks' parity gate: :mod:`fastzoo.parity`'s comparisons applied to a case's outputs.

``fastzoo check`` (:func:`fastzoo.parity.check_parity`) builds its own models and inputs;
a benchmark must prove the exact thing it times (its inputs, its layout, the peer library,
the compiled model), so it hands its tensors to the same comparison functions and the
same rule: fp32 outputs within 1e-4 of the fp32 eager reference and gradients within a
relative 1e-4; in low precision, within 3x the eager model's own error in that dtype.

A case is a dict ``{"output": tensor, "grad:<param>": tensor, ...}``. A peer from another
library may name its parameters differently: its gradients are compared on the names
and shapes both sides share (none shared: outputs only).
"""
from __future__ import annotations

import torch

from fastzoo.parity import Comparison
from fastzoo.parity import _compare_grads as compare_grads
from fastzoo.parity import _compare_outputs as compare_outputs


def _grads(d: dict) -> dict[str, torch.Tensor]:
    return {k[len("grad:"):]: v for k, v in d.items() if k.startswith("grad:")}


def compare(ref: dict, got: dict, peer: dict | None = None, *, same_names: bool = True) -> list[Comparison]:
    """Outputs, then gradients (when the case has them), of ``got`` against the fp32 ``ref``.

    ``peer``: the eager model's outputs in the same low precision (None in fp32).
    ``same_names=False``: compare gradients only on the parameters both sides share.
    """
    comps = [compare_outputs("output", got["output"].float(), ref["output"].float(), peer and peer["output"].float())]
    g, g_ref = _grads(got), _grads(ref)
    if not g or not g_ref:
        return comps
    g_peer = _grads(peer) if peer is not None else None
    if not same_names:
        shared = {k for k in g_ref if k in g and g[k].shape == g_ref[k].shape and (g_peer is None or k in g_peer)}
        if not shared:
            return comps
        g, g_ref = {k: g[k] for k in shared}, {k: g_ref[k] for k in shared}
        g_peer = {k: g_peer[k] for k in shared} if g_peer is not None else None
    comps.append(compare_grads("grads", g, g_ref, g_peer))
    return comps
