"""Every ResNet-family name (torchvision's and timm's: resnet18 ... resnext101_64x4d) is the
original's network: at one block per stage with the real widths, the same logits and gradients
as torchvision's model on the same weights; at full size, the same parameters on the meta
device; timm's weights load and go back; the FLOP count is the one torch counts; the box
detector takes each as its backbone."""
import pytest
import timm
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import fastzoo
from fastzoo.equivalence import compare
from fastzoo.registry import get_entry, specs
from tests.conftest import randomize

NAMES = [v.name for s in specs() if s.family == "resnet" for v in s.variants]
ONE_BLOCK = dict(layers=(1, 1, 1, 1))  # every stage's width and block kind, the least depth
# one of each kind of block: basic, grouped bottleneck, widened bottleneck
KINDS = ["resnet18", "resnext101_64x4d", "wide_resnet50_2"]


def _torchvision(name: str) -> torch.nn.Module:
    """torchvision's model of ``name`` at one block per stage, random BatchNorm statistics."""
    entry = get_entry(name)
    return randomize(entry.spec.original.build({**entry.config, **ONE_BLOCK}))


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(3))  # C5 is 1x1: the least work


def test_the_family_has_torchvisions_names():
    assert NAMES == ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2",
                     "wide_resnet101_2", "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d"]
    assert fastzoo.list_models("resnext*") == ["resnext101_32x8d", "resnext101_64x4d", "resnext50_32x4d"]
    for name in NAMES:  # each carries timm's pretrained_cfg of the same name
        assert fastzoo.create(name, device="meta").pretrained_cfg["architecture"] == name


@pytest.mark.parametrize("name", NAMES)
def test_equals_torchvision_at_one_block_per_stage(name):
    """fastzoo.equivalence's fp32 rule (logits within 1e-4, gradients within 1e-4 relative) against
    torchvision's model of the same name, random BatchNorm statistics, config read from the module."""
    ref = _torchvision(name)
    ours = fastzoo.create(name, pretrained=ref)
    assert (ours.config.block, ours.config.groups, ours.config.width_per_group) == tuple(
        get_entry(name).config[k] for k in ("block", "groups", "width_per_group"))
    comparisons, _ = compare(ours.eval(), ref.eval(), (_images(),))
    assert [c.name for c in comparisons] == ["logits", "grads"]
    for c in comparisons:
        assert c.passed, f"{name} {c.name}: {c.err:.3g} > {c.bound:g} ({c.worst})"


@pytest.mark.parametrize("name", NAMES)
def test_full_size_has_the_originals_parameters(name):
    with torch.device("meta"):
        tv = torchvision.models.get_model(name)
    ours = fastzoo.create(name, device="meta")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in tv.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in tv.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_flops_are_the_ones_torch_counts(name):
    """The spec's count (benchmarks divide by it) equals torch's FlopCounterMode on a forward,
    at full depth, on the meta device (nothing is computed)."""
    model = fastzoo.create(name, device="meta").eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(2, 3, 64, 64, device="meta"))
    assert get_entry(name).spec.flops(model.config, batch=2, img_size=64, train=False) == counter.get_total_flops()


@pytest.mark.parametrize("name", KINDS)
def test_timm_weights_load_and_export_back(name):
    """A live timm model and its bare state dict both load (the keys tell the block, groups and
    width); the export loads strictly into timm and torchvision and computes what fastzoo does."""
    peer = randomize(timm.create_model(name, pretrained=False, **ONE_BLOCK)).eval()
    x = _images(1)
    for source in (peer, peer.state_dict()):
        ours = fastzoo.create("resnet50", pretrained=source).eval()  # any family name: the weights decide
        assert (ours(x) - peer(x)).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance
    for fmt, back in (("timm", timm.create_model(name, pretrained=False, **ONE_BLOCK)), ("torchvision", _torchvision(name))):
        back.load_state_dict(fastzoo.export_state_dict(ours, fmt), strict=True)
        assert (back.eval()(x) - ours(x)).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance


@pytest.mark.parametrize("name", KINDS)
def test_box_detector_takes_it_as_backbone(name):
    """Sizes from the variant; C5 channels from the backbone; the torchvision model's weights load
    into it; a detector state dict tells its backbone's kind back."""
    tv = _torchvision(name).eval()
    det = fastzoo.create("boxdet_r50", **{**get_entry(name).config, **ONE_BLOCK}, hidden_dim=16, num_queries=2).eval()
    assert det.input_proj.in_channels == tv.fc.in_features
    det.load_backbone(tv)
    x = _images(1)
    c5 = torch.nn.Sequential(*list(tv.children())[:-2])(x)
    assert (det.backbone.forward_features(x) - c5).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance
    again = fastzoo.create("boxdet_r50", pretrained=det.state_dict())
    for field in ("block", "layers", "channels", "groups", "width_per_group"):
        assert getattr(again.config, field) == getattr(det.config, field), field
