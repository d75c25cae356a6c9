"""The ResNet family under torchvision's and timm's names (resnet18 ... resnext101_64x4d), beyond
what tests/test_registry.py checks of every name (full-size parameter count, one block per stage
against torchvision): timm's weights of each block kind load, tell their shape and go back; the
FLOP count is the one torch counts."""
import pytest
import timm
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo.registry import get_entry, specs

NAMES = [v.name for s in specs() if s.family == "resnet" for v in s.variants]
ONE_BLOCK = dict(layers=(1, 1, 1, 1))  # every stage's width and block kind, the least depth
# one of each kind of block: basic, grouped bottleneck, widened bottleneck
KINDS = ["resnet18", "resnext101_64x4d", "wide_resnet50_2"]


def _torchvision(name: str) -> torch.nn.Module:
    """torchvision's model of ``name`` at one block per stage, random BatchNorm statistics."""
    entry = get_entry(name)
    return draw_(entry.spec.original.build({**entry.config, **ONE_BLOCK}))


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(3))  # C5 is 1x1: the least work


def test_the_family_has_torchvisions_names():
    assert [n for n in NAMES if "/" not in n] == [
        "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "wide_resnet101_2",
        "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d"]
    assert [n for n in NAMES if "/" in n] == [f"microsoft/resnet-{d}" for d in (18, 26, 34, 50, 101, 152)]  # HF hub ids
    assert fastzoo.list_models("resnext*") == ["resnext101_32x8d", "resnext101_64x4d", "resnext50_32x4d"]
    for name in NAMES:  # each carries timm's pretrained_cfg of the same name (a hub id: of timm's same network)
        assert fastzoo.create(name, device="meta").pretrained_cfg["architecture"] == name.replace("microsoft/resnet-", "resnet")


@pytest.mark.parametrize("name", NAMES)
def test_flops_are_the_ones_torch_counts(name):
    """The spec's count (benchmarks divide by it) equals torch's FlopCounterMode on a forward,
    at full depth, on the meta device (nothing is computed)."""
    model = fastzoo.create(name, device="meta").eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(2, 3, 64, 64, device="meta"))
    assert get_entry(name).spec.flops(model.config, batch=2, img_size=64, train=False) == counter.get_total_flops()


@pytest.mark.parametrize("name", KINDS)
def test_timm_weights_load_and_export_back(name, tmp_path):
    """A live timm model and its bare state dict both load (the keys tell the block, groups and
    width); the export loads strictly into timm and torchvision, and a save_pretrained directory
    into timm.create_model("local-dir:..."), each computing what fastzoo does."""
    peer = draw_(timm.create_model(name, pretrained=False, **ONE_BLOCK)).eval()
    x = _images(1)
    for source in (peer, peer.state_dict()):
        ours = fastzoo.create("resnet50", pretrained=source).eval()  # any family name: the weights decide
        assert (ours(x) - peer(x)).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance
    for fmt, back in (("timm", timm.create_model(name, pretrained=False, **ONE_BLOCK)), ("torchvision", _torchvision(name))):
        back.load_state_dict(fastzoo.export_state_dict(ours, fmt), strict=True)
        assert (back.eval()(x) - ours(x)).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance
    named = fastzoo.create(name, pretrained=peer.state_dict()).eval()
    named.save_pretrained(tmp_path)  # timm's architecture and model_args (cardinality, base_width) go with it
    back = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert (back(x) - named(x)).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance
    if ours.config.block == "basic":  # resnet50's pretrained_cfg on basic blocks: timm would build bottlenecks
        assert "architecture" not in ours.extra_config()
