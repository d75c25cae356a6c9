"""ResNet-50 equals torchvision's and timm's resnet50 on the same weights: logits and
gradients, eval and train mode BatchNorm, channels_last, and checkpoint round trips."""
import pytest
import timm
import torch
import torchvision
from conftest import TINY
from torch import nn

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo.errors import CheckpointError

TOL = 1e-4  # fastzoo.equivalence's rule: fp32 CPU, max abs logit difference; same op order, so float noise only


def _peer(name: str, **kw) -> nn.Module:
    if name == "torchvision":
        return draw_(torchvision.models.resnet50(**kw))
    return draw_(timm.create_model("resnet50", pretrained=False, **kw))


def _max_rel_grad_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """Largest |ga - gb| / max|gb| over parameters of the same name (grads vary in scale per layer)."""
    ga, gb = dict(a.named_parameters()), dict(b.named_parameters())
    assert ga.keys() == gb.keys()
    return max((((ga[k].grad - gb[k].grad).abs().max() / gb[k].grad.abs().max().clamp_min(1e-12)).item(), k) for k in ga)


@pytest.mark.parametrize("peer_name", ["torchvision", "timm"])
@pytest.mark.parametrize("train", [False, True])
def test_logits_and_grads_equal_peer(peer_name, train):
    peer = _peer(peer_name)
    ours = fastzoo.create("resnet50", pretrained=peer)
    peer.train(train), ours.train(train)
    x = torch.randn(2, 3, 64, 64)
    ref, out = peer(x), ours(x)
    assert out.shape == (2, 1000)
    assert (out - ref).abs().max().item() <= TOL
    w = torch.randn_like(out)  # one upstream gradient for both
    (ref * w).sum().backward()
    (out * w).sum().backward()
    diff, name = _max_rel_grad_diff(ours, peer)
    assert diff <= 1e-4, f"{name}: relative grad diff {diff}"  # fp32 reassociation noise only
    if train:  # train-mode BN updated the running stats the same way
        sp, so = peer.state_dict(), ours.state_dict()
        for k in sp:
            if "running" in k:
                assert (sp[k] - so[k]).abs().max().item() <= 1e-5, k
            if "num_batches_tracked" in k:
                assert sp[k].item() == so[k].item() == 1, k


def test_channels_last_is_the_same_function():
    peer = _peer("torchvision").eval()
    a = fastzoo.create("resnet50", pretrained=peer).eval()
    b = fastzoo.create("resnet50", pretrained=peer, channels_last=True).eval()
    assert b.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert b.layer3[0].conv2.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(1, 3, 64, 64)  # a contiguous NCHW input: forward converts it
    ya, yb = a(x), b(x)
    assert (ya - yb).abs().max().item() <= TOL  # different conv kernels for NHWC: float noise only
    ya.sum().backward(), yb.sum().backward()
    diff, name = _max_rel_grad_diff(b, a)
    assert diff <= 1e-4, f"{name}: relative grad diff {diff}"


@pytest.mark.parametrize("fmt", ["torchvision", "timm"])
def test_export_loads_strictly_into_peer(fmt):
    ours = draw_(fastzoo.create("resnet50")).eval()
    sd = fastzoo.export_state_dict(ours, fmt)
    peer = torchvision.models.resnet50() if fmt == "torchvision" else timm.create_model("resnet50")
    peer.load_state_dict(sd, strict=True)
    peer.eval()
    x = torch.randn(1, 3, 64, 64)
    assert (peer(x) - ours(x)).abs().max().item() <= TOL


def test_save_pretrained_and_file_round_trip(tmp_path):
    from safetensors.torch import save_file

    peer = _peer("torchvision", num_classes=10).eval()
    save_file(peer.state_dict(), str(tmp_path / "tv.safetensors"))
    a = fastzoo.create("resnet50", pretrained=tmp_path / "tv.safetensors").eval()
    assert a.config.num_classes == 10  # read from fc.weight
    a.save_pretrained(tmp_path / "saved")
    b = fastzoo.create("resnet50", pretrained=tmp_path / "saved").eval()
    x = torch.randn(1, 3, 64, 64)
    ref = peer(x)
    assert (a(x) - ref).abs().max().item() <= TOL
    assert torch.equal(a(x), b(x))  # identical weights, identical program


def test_checkpoint_without_num_batches_tracked_loads():
    peer = _peer("torchvision").eval()
    sd = {k: v for k, v in peer.state_dict().items() if not k.endswith("num_batches_tracked")}
    ours = fastzoo.create("resnet50", pretrained=sd).eval()
    assert ours.bn1.num_batches_tracked.item() == 0
    x = torch.randn(1, 3, 64, 64)
    assert (ours(x) - peer(x)).abs().max().item() <= TOL


def test_num_classes_override_gives_fresh_fc():
    peer = _peer("torchvision")
    with pytest.warns(UserWarning, match="fresh fc"):
        ours = fastzoo.create("resnet50", pretrained=peer, num_classes=7)
    assert ours.fc.weight.shape == (7, 2048)
    assert torch.equal(ours.layer4[2].conv3.weight, peer.layer4[2].conv3.weight)


def test_deeper_and_slimmer_checkpoints_infer_their_shape():
    peer = torchvision.models.resnet101(num_classes=3)
    ours = fastzoo.create("resnet50", pretrained=peer)
    assert ours.config.layers == (3, 4, 23, 3)
    sizes = {**TINY["resnet"], "channels": (8, 16, 32, 64)}  # narrower than resnet50's stages: the weights must tell
    slim = fastzoo.create("resnet50", **sizes)
    again = fastzoo.create("resnet50", pretrained=slim.state_dict())
    assert again.config.layers == sizes["layers"] and again.config.channels == sizes["channels"]


def test_attention_backend_choice_is_harmless():
    r = fastzoo.create("resnet50", attn="eager", **TINY["resnet"])
    r.set_attention("flex")  # nothing to switch in a ResNet
    assert r.attention_backend is None


def test_bad_inputs_raise():
    r = fastzoo.create("resnet50", **TINY["resnet"])
    with pytest.raises(ValueError, match="images"):
        r(torch.randn(3, 64, 64))
    with pytest.raises(CheckpointError, match="not a resnet checkpoint"):
        fastzoo.create("resnet50", pretrained={"patch_embed.proj.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="missing keys"):
        sd = _peer("torchvision").state_dict()
        sd.pop("layer2.0.bn2.weight")
        fastzoo.create("resnet50", pretrained=sd)


# -- live modules: what the keys cannot show ---------------------------------------------
def _tv_small(**kw):
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], **kw)


@pytest.mark.parametrize("build,needle", [
    (lambda: _tv_small(replace_stride_with_dilation=[False, True, False]), "layer3.0.conv2 has kernel/stride"),
    (lambda: timm.create_model("resnet26", act_layer="silu"), "act1 is a torch.nn.modules.activation.SiLU"),
    (lambda: timm.create_model("resnet26", aa_layer=nn.AvgPool2d), "AvgPool2d"),
    (lambda: timm.create_model("resnet26", drop_block_rate=0.1), "DropBlock2d"),
    (lambda: timm.create_model("resnet26", drop_path_rate=0.1), "DropPath"),
    (lambda: timm.create_model("resnet26", drop_rate=0.2), "drop_rate=0.2"),
    (lambda: timm.create_model("resnet26", global_pool="max"), "pool_type=max"),
    (lambda: _tv_small(norm_layer=lambda c: nn.BatchNorm2d(c, eps=1e-3)), "bn1 has eps=0.001"),
    (lambda: _tv_small(norm_layer=lambda c: nn.BatchNorm2d(c, momentum=0.01)), "momentum=0.01"),
    (lambda: timm.create_model("resnet18", layers=(1, 1, 1, 1), act_layer="silu"), "layer1.0.act1 is a"),
], ids=["tv-dilation-layer3-only", "timm-silu", "timm-aa", "timm-dropblock", "timm-droppath", "timm-droprate",
        "timm-maxpool", "bn-eps", "bn-momentum", "timm-basic-silu"])
def test_live_module_of_another_function_is_refused(build, needle):
    """Same keys and shapes, another function: create and load_pretrained refuse it by name."""
    peer = build()
    with pytest.raises(CheckpointError, match="not the function of fastzoo's ResNet") as e:
        fastzoo.create("resnet50", pretrained=peer)
    assert needle in str(e.value) and "module.state_dict()" in str(e.value)
    ours = fastzoo.create("resnet50", pretrained=peer.state_dict())  # weights alone: documented, read as the plain network
    with pytest.raises(CheckpointError, match="not the function"):
        fastzoo.load_pretrained(ours, peer)


def test_live_timm_options_that_keep_the_function_load():
    peer = draw_(timm.create_model("resnet26", zero_init_last=False)).eval()  # init only
    ours = fastzoo.create("resnet50", pretrained=peer).eval()
    x = torch.randn(1, 3, 64, 64)
    assert (ours(x) - peer(x)).abs().max().item() <= TOL


def test_frozen_batchnorm_module_loads_as_frozen_bn():
    """torchvision's FrozenBatchNorm2d (DETR's backbone): frozen_bn=True, the same function in
    train mode too (statistics unchanged, BN affine untrained)."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    peer = draw_(torchvision.models.resnet50(norm_layer=FrozenBatchNorm2d))  # its statistics, buffers, drawn too
    ours = fastzoo.create("resnet50", pretrained=peer).train()
    assert ours.config.frozen_bn and not ours.bn1.training and not ours.layer2[0].bn2.weight.requires_grad
    before = ours.layer1[0].bn1.running_mean.clone()
    x = torch.randn(2, 3, 64, 64)
    ref, out = peer(x), ours(x)
    # FrozenBatchNorm2d folds BN into scale/shift, F.batch_norm does not: float noise only
    assert (out - ref).abs().max().item() <= TOL
    assert torch.equal(ours.layer1[0].bn1.running_mean, before)
    w = torch.randn_like(out)
    (ref * w).sum().backward(), (out * w).sum().backward()
    conv = ours.layer3[0].conv2.weight.grad
    assert ((conv - peer.layer3[0].conv2.weight.grad).abs().max() / conv.abs().max()).item() <= 1e-4  # fp32 noise
    assert ours.bn1.weight.grad is None
