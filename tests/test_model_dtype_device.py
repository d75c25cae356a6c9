"""Image models given images of another dtype than their weights, and models built on the meta
device (the big-model init idiom).

A forward whose images and weights disagree in dtype (no autocast) is refused at the model's
input with a ValueError naming ``images`` and both dtypes, not torch's dtype error deep inside
a convolution; the check stays outside compiled / exported graphs and autocast still works.
A model built under ``torch.device("meta")`` (or ``create(..., device="meta")``), then
``to_empty`` and loaded, computes exactly what the normally built model with those weights does.
"""
from __future__ import annotations

import pytest
import torch
from conftest import TINY

import fastzoo
from tests.test_peer_api import NARROW, RESNET_TINY, VIT_TINY

IMAGE_MODELS = {"vit": ("vit_s16", VIT_TINY), "resnet": ("resnet50", {**RESNET_TINY, **NARROW}), "detr": ("detr", TINY["detr"])}
LOW = [torch.float16, torch.bfloat16]


def _image_model(kind, dtype=torch.float32):
    name, kw = IMAGE_MODELS[kind]
    torch.manual_seed(0)
    return fastzoo.create(name, **kw).eval().to(dtype)


def _images(dtype=torch.float32, batch=2):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(dtype)


def _logits(out):
    return out["logits"] if isinstance(out, dict) else out


# -- images of another dtype than the weights ------------------------------------------------
@pytest.mark.parametrize("kind", list(IMAGE_MODELS))
@pytest.mark.parametrize("images_dtype, weights_dtype", [(low, torch.float32) for low in LOW]
                         + [(torch.float32, low) for low in LOW] + [(torch.float16, torch.bfloat16)])
def test_images_of_another_dtype_than_the_weights_are_refused_naming_both(kind, images_dtype, weights_dtype):
    m = _image_model(kind, weights_dtype)
    with pytest.raises(ValueError, match=rf"images are {images_dtype}.*weights are {weights_dtype}"):
        m(_images(images_dtype))


@pytest.mark.parametrize("kind", list(IMAGE_MODELS))
def test_dtype_check_runs_in_compiled_and_exported_graphs(kind):
    """Compiled, the check still refuses (a dtype is static: dynamo guards on it and re-traces);
    with fullgraph=True dynamo reports any raise as its own Unsupported error, which carries the
    message. torch.export of the good dtype still works."""
    m = _image_model(kind)
    msg = r"images are torch.bfloat16 but the model's weights are torch.float32"
    for fullgraph, error in ((False, ValueError), (True, torch._dynamo.exc.Unsupported)):
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=fullgraph, backend="eager")
        assert torch.equal(_logits(compiled(_images())), _logits(m(_images())))
        with pytest.raises(error, match=msg):
            compiled(_images(torch.bfloat16))
    ep = torch.export.export(m, (_images(),))
    assert torch.equal(_logits(ep.module()(_images())), _logits(m(_images())))


@pytest.mark.parametrize("kind", list(IMAGE_MODELS))
@pytest.mark.parametrize("images_dtype", [torch.float32, torch.bfloat16])
def test_autocast_bf16_forward_is_not_refused_and_is_close_to_fp32(kind, images_dtype):
    """Under autocast the weights stay fp32 and the convs / matmuls run in bf16: images of either
    dtype are fine. Tolerance: bf16 has 8 mantissa bits; 0.1 of the logits' scale covers its
    rounding through these few layers."""
    m = _image_model(kind)
    ref = _logits(m(_images())).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _logits(m(_images(images_dtype))).float()
    assert (out - ref).abs().max().item() <= 0.1 * ref.abs().max().item() + 1e-3


def test_images_on_another_device_than_the_weights_are_refused():
    m = _image_model("resnet").to("meta")
    with pytest.raises(ValueError, match="images are on cpu but the model is on meta"):
        m(_images())


# -- built on the meta device ----------------------------------------------------------------
ALL_MODELS = {**IMAGE_MODELS, "gpt2": ("gpt2", TINY["gpt2"])}


def _inputs(kind):
    if kind == "gpt2":
        return (torch.randint(0, TINY["gpt2"]["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0)),)
    return (_images(),)


def _outputs(kind, model):
    out = model(*_inputs(kind))
    return out.logits if kind == "gpt2" else _logits(out)


@pytest.mark.parametrize("kind", list(ALL_MODELS))
@pytest.mark.parametrize("how", ["context", "device="])
def test_built_on_meta_then_to_empty_and_loaded_equals_the_normal_build(kind, how):
    name, kw = ALL_MODELS[kind]
    torch.manual_seed(0)
    normal = fastzoo.create(name, **kw).eval()
    if how == "context":
        with torch.device("meta"):
            m = fastzoo.create(name, **kw)
    else:
        m = fastzoo.create(name, device="meta", **kw)
    assert {p.device.type for p in m.parameters()} | {b.device.type for b in m.buffers()} == {"meta"}
    m.to_empty(device="cpu")
    fastzoo.load_pretrained(m, normal.state_dict())
    m.eval()
    assert torch.equal(_outputs(kind, m), _outputs(kind, normal))  # same weights, same ops: bit for bit


def test_meta_device_with_pretrained_is_refused_with_the_idiom():
    with pytest.raises(ValueError, match="to_empty"):
        fastzoo.create("resnet50", device="meta", pretrained=_image_model("resnet").state_dict(), **RESNET_TINY, **NARROW)


def test_fx_traced_resnet_checks_against_the_weights_it_has_when_run():
    """The traced graph reads the stem weight when it runs: converted after tracing, it takes
    images of its new dtype and refuses the old one."""
    from torchvision.models.feature_extraction import create_feature_extractor

    traced = create_feature_extractor(_image_model("resnet"), ["layer2"])
    with pytest.raises(ValueError, match="images are torch.float16"):
        traced(_images(torch.float16))
    traced = traced.to(torch.bfloat16)
    assert traced(_images(torch.bfloat16))["layer2"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="images are torch.float32 but the model's weights are torch.bfloat16"):
        traced(_images())
