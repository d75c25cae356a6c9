"""Dilated ResNets (``output_stride`` 16 and 8, Yu & Koltun 2016): fastzoo equals timm's
``output_stride`` model and torchvision's ``replace_stride_with_dilation`` one on the same weights
(logits and every gradient), reads the output stride back from a live module, refuses the dilation
patterns no output stride gives by name, and hands it on to timm through save_pretrained."""
import pytest
import timm
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo.errors import CheckpointError, ConfigError
from fastzoo.registry import get_entry

TOL = 1e-4  # fastzoo.equivalence's rule: fp32 CPU, max abs difference; the same convs, so float noise only
# two blocks in the last two stages: a dilated stage's first block keeps the previous dilation, the next does not
LAYERS = (1, 1, 2, 2)


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(5))


def _timm(name: str, output_stride: int) -> torch.nn.Module:
    return draw_(timm.create_model(name, pretrained=False, layers=LAYERS, output_stride=output_stride,
                                       zero_init_last=False))


def _max_grad_diff(ours, peer) -> tuple[float, str]:
    """Largest |g_ours - g_peer| / max|g_peer| over the parameters (gradients differ in scale per layer)."""
    a, b = dict(ours.named_parameters()), dict(peer.named_parameters())
    assert a.keys() == b.keys()
    return max((((a[k].grad - b[k].grad).abs().max() / b[k].grad.abs().max().clamp_min(1e-12)).item(), k) for k in a)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("output_stride", [16, 8])
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_equals_timm_output_stride(name, output_stride, train):
    peer = _timm(name, output_stride)
    ours = fastzoo.create(name, pretrained=peer)
    assert ours.config.output_stride == output_stride  # read from the live module's strides
    peer.train(train), ours.train(train)
    x = _images()
    ref, out = peer(x), ours(x)
    assert (out - ref).abs().max().item() <= TOL
    side = 64 // output_stride
    assert ours.forward_features(x).shape[-2:] == (side, side)
    w = torch.randn_like(out)  # one upstream gradient for both
    (ref * w).sum().backward()
    (out * w).sum().backward()
    diff, where = _max_grad_diff(ours, peer)
    assert diff <= 1e-4, f"{where}: relative gradient difference {diff}"  # fp32 reassociation noise only


@pytest.mark.parametrize("output_stride", [16, 8])
def test_state_dict_with_output_stride_override(output_stride):
    """A bare state dict cannot show the dilation: the user says it, and gets timm's function."""
    peer = _timm("resnet50", output_stride).eval()
    ours = fastzoo.create("resnet50", pretrained=peer.state_dict(), output_stride=output_stride).eval()
    x = _images()
    assert (ours(x) - peer(x)).abs().max().item() <= TOL
    plain = fastzoo.create("resnet50", pretrained=peer.state_dict()).eval()  # undilated: another function
    assert plain.config.output_stride == 32 and plain.forward_features(x).shape[-1] == 2


@pytest.mark.parametrize("output_stride,dilate", [(16, [False, False, True]), (8, [False, True, True])])
@pytest.mark.parametrize("kind", [dict(), dict(groups=32, width_per_group=4)], ids=["resnet", "resnext"])
def test_torchvision_replace_stride_with_dilation_is_timms_function(output_stride, dilate, kind):
    """torchvision's dilated bottleneck ResNet (first block of a dilated stage at the previous dilation,
    as timm) loads as output_stride 16 / 8, and timm's model of that output stride computes it too."""
    from torchvision.models.resnet import Bottleneck, ResNet

    tv = draw_(ResNet(Bottleneck, list(LAYERS), replace_stride_with_dilation=dilate, **kind)).eval()
    ours = fastzoo.create("resnet50", pretrained=tv).eval()
    assert ours.config.output_stride == output_stride
    t = timm.create_model("resnext50_32x4d" if kind else "resnet50", layers=LAYERS, output_stride=output_stride)
    t.load_state_dict(tv.state_dict())
    x = _images()
    assert (ours(x) - tv(x)).abs().max().item() <= TOL
    assert (t.eval()(x) - tv(x)).abs().max().item() <= TOL


@pytest.mark.parametrize("dilate,needle", [([True, False, False], "layer2.0.conv2"),
                                           ([False, True, False], "layer3.0.conv2"),
                                           ([True, True, True], "layer2.0.conv2")])
def test_dilation_no_output_stride_gives_is_refused(dilate, needle):
    """torchvision dilates any stages; timm's output stride dilates the last ones: the others are
    refused by name (same keys, another function)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    tv = ResNet(Bottleneck, list(LAYERS), replace_stride_with_dilation=dilate)
    with pytest.raises(CheckpointError, match="not the function of fastzoo's ResNet") as e:
        fastzoo.create("resnet50", pretrained=tv)
    assert needle in str(e.value) and "replace_stride_with_dilation" in str(e.value)


def test_load_pretrained_checks_the_output_stride():
    """A live dilated module into an undilated model (and back) is refused naming output_stride."""
    peer = _timm("resnet50", 16)
    plain = fastzoo.create("resnet50", layers=LAYERS)
    with pytest.raises(CheckpointError, match="output_stride: checkpoint 16 vs model 32"):
        fastzoo.load_pretrained(plain, peer)
    dilated = fastzoo.create("resnet50", layers=LAYERS, output_stride=16)
    fastzoo.load_pretrained(dilated, peer)  # the same function: loads
    with pytest.raises(CheckpointError, match="output_stride: checkpoint 32 vs model 16"):
        fastzoo.load_pretrained(dilated, _timm("resnet50", 32))


def test_transformers_resnet_has_no_dilation():
    with pytest.raises(ConfigError, match="transformers' ResNet has no dilated stages") as e:
        fastzoo.create("microsoft/resnet-50", output_stride=16, device="meta")
    assert set(e.value.fields) == {"output_stride", "hf_config"}
    plain = fastzoo.create("resnet50", layers=LAYERS, output_stride=16)  # no hf_config: no transformers form to write
    with pytest.raises(CheckpointError, match="output_stride=16"):
        plain.hf_pretrained()
    with pytest.raises(ConfigError, match="output_stride"):
        fastzoo.create("resnet50", output_stride=4, device="meta")


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_save_pretrained_rebuilds_in_timm(name, tmp_path):
    """timm's hub config carries output_stride in model_args: timm and fastzoo rebuild the dilated net."""
    ours = fastzoo.create(name, pretrained=_timm(name, 8).state_dict(), output_stride=8).eval()
    ours.save_pretrained(tmp_path)
    back = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    again = fastzoo.create(pretrained=str(tmp_path)).eval()
    x = _images()
    assert again.config.output_stride == 8
    assert (back(x) - ours(x)).abs().max().item() <= TOL
    assert (again(x) - ours(x)).abs().max().item() <= TOL


@pytest.mark.parametrize("output_stride", [32, 16, 8])
def test_feature_maps_and_flops_follow_the_output_stride(output_stride):
    """feature_info's reductions are timm's; features_only returns maps of those sizes; the spec's
    FLOP count is the one torch counts (dilated stages keep their map size)."""
    peer = timm.create_model("resnet50", layers=LAYERS, output_stride=output_stride)
    ours = fastzoo.create("resnet50", layers=LAYERS, output_stride=output_stride).eval()
    assert [f["reduction"] for f in ours.feature_info] == [f["reduction"] for f in peer.feature_info]
    features = fastzoo.create("resnet50", layers=LAYERS, output_stride=output_stride, features_only=True)
    maps = features(torch.randn(1, 3, 64, 64))
    assert [m.shape[-1] for m in maps] == [64 // f["reduction"] for f in peer.feature_info]
    with FlopCounterMode(display=False) as counter:
        ours(torch.randn(2, 3, 64, 64))
    assert get_entry("resnet50").spec.flops(ours.config, batch=2, img_size=64, train=False) == counter.get_total_flops()


def test_original_builder_takes_the_output_stride():
    """The spec's original (what the fuzz compares with): torchvision's for bottlenecks, timm's for
    dilated basic blocks (torchvision's BasicBlock has no dilation)."""
    build = get_entry("resnet50").spec.original.build
    tv = build(dict(layers=LAYERS, output_stride=8, num_classes=10))
    assert isinstance(tv, torchvision.models.ResNet) and tv.layer4[0].conv2.dilation == (2, 2)
    basic = build(dict(block="basic", layers=LAYERS, output_stride=16, num_classes=10))
    assert isinstance(basic, timm.models.ResNet) and basic.layer4[1].conv1.dilation == (2, 2)
