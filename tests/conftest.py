"""Fixtures built from the family specs (``fastzoo/models/<family>/spec.py``): each family's
tiny config, the original library's model on the same config, and one way to randomise weights
that random init leaves trivial (BatchNorm statistics)."""
import pytest
import torch
from torch import nn

from fastzoo.registry import specs

# family -> its spec's tiny config (original field names), e.g. TINY["vit"]
TINY = {spec.family: dict(spec.tiny) for spec in specs()}
SPECS = {spec.family: spec for spec in specs()}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def cuda_only(reason: str = "needs a CUDA GPU; this machine has none"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


def original(family: str, **overrides) -> nn.Module:
    """The original library's model of ``family`` on its tiny config plus ``overrides``, eval mode."""
    spec = SPECS[family]
    return spec.original.build({**spec.tiny, **overrides}).eval()


def randomize(model: nn.Module, seed: int = 1) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine weights (random init leaves them 0 / 1,
    which hides a mixed-up mean and variance)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=g) * 0.5 + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return model


def backends(*, backward: bool = False, device: str = "cpu", **needs) -> list[tuple[str, dict]]:
    """``(name, options)`` of every registered backend, default and each declared variant (e.g.
    ``sdpa_backend="math"``), that runs on ``device`` here, with a backward there if ``backward``,
    and whose capabilities have each of ``needs`` (``varlen=True``, ``padding_mask=True``...).
    The registry decides: a new backend is tested without editing a list."""
    from fastzoo.attention import backend_class, get_backend, list_attention

    out = []
    for name in list_attention(available_only=True):
        for options in ({}, *getattr(backend_class(name), "variants", ())):
            try:
                caps = get_backend(name, **options).capabilities
            except Exception:  # a variant this machine cannot build (a kernel library missing)
                continue
            runs = device in caps.devices and (not backward or device in caps.backward)
            if runs and all(getattr(caps, k) == v for k, v in needs.items()) and (name, options) not in out:
                out.append((name, options))
    return out


def backend_id(b) -> str:
    name, options = b
    return name + "".join(f"-{v}" for v in options.values())
