"""DETR-DC5 (transformers' ``dilation=True``: timm's backbone at ``output_stride=16``, its last stage
dilated) against transformers' ``DetrForObjectDetection`` on the same weights: logits, boxes, the loss,
each ``loss_dict`` term and every gradient on every CPU attention backend with a backward, on padded
images whose mask is resized to the stride-16 map; checkpoints both ways; the hub names; and what
transformers' config says against what it builds (its own ResNet backbone has no dilation)."""
import types

import pytest
import torch
import transformers
from conftest import SPECS, backends
from test_detr import OUT_TOL, TINY, batch, boxes_labels, compare, hf_detr

import fastzoo
from fastzoo.errors import CheckpointError, ConfigError

# timm's ResNet-18: two basic blocks in the dilated stage (the first keeps the previous dilation)
R18 = dict(use_timm_backbone=True, backbone="resnet18", embedding_size=None, hidden_sizes=None, depths=None)


@pytest.fixture(scope="module")
def hf_dc5():
    hf = hf_detr(**R18, dilation=True, auxiliary_loss=True)
    layer4 = hf.model.backbone.model.layer4  # transformers asked timm for output_stride=16
    assert hf.config.backbone_config.output_stride == 16
    assert (layer4[0].conv1.stride, layer4[0].conv1.dilation, layer4[0].conv2.dilation) == ((1, 1), (1, 1), (2, 2))
    return hf


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_equal_to_transformers_for_every_backend(hf_dc5, attn):
    """Padded images of 64 x 80 (a 4 x 5 map at stride 16), 2, 0 and 5 boxes, auxiliary loss."""
    name, options = attn
    ours = fastzoo.create("detr", pretrained=hf_dc5).set_attention(name, **options).train()
    assert ours.config.dilation
    compare(hf_dc5, ours, *batch())


def test_the_feature_map_has_stride_16(hf_dc5):
    ours = fastzoo.create("detr", pretrained=hf_dc5)
    x, mask, _ = batch()
    f, m = ours.model.backbone(x, mask)
    assert f.shape[-2:] == (4, 5) and m.shape[-2:] == (4, 5)
    plain = fastzoo.create("detr", **{**TINY, **R18})
    assert plain.model.backbone(x, mask)[0].shape[-2:] == (2, 3)  # stride 32


def test_save_pretrained_round_trips_with_transformers(hf_dc5, tmp_path):
    """fastzoo writes dilation=True (and timm's output_stride=16): transformers rebuilds DC5; a
    transformers directory reads back as DC5."""
    import json

    ours = fastzoo.create("detr", pretrained=hf_dc5).eval()
    ours.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["dilation"] is True and written["backbone_config"]["output_stride"] == 16
    back = transformers.DetrForObjectDetection.from_pretrained(tmp_path / "ours").eval()
    assert back.model.backbone.model.layer4[1].conv1.dilation == (2, 2)
    hf_dc5.save_pretrained(tmp_path / "hf")
    again = fastzoo.create("detr", pretrained=tmp_path / "hf").eval()
    assert again.config.dilation
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = hf_dc5.eval()(pixel_values=x).logits
        assert (back(pixel_values=x).logits - ref).abs().max() <= OUT_TOL
        assert (again(pixel_values=x).logits - ref).abs().max() <= OUT_TOL
        assert (ours(pixel_values=x).logits - ref).abs().max() <= OUT_TOL
    hf_dc5.train()


def test_a_state_dict_is_dc5_when_told_and_checked_against_a_live_model(hf_dc5):
    """Keys cannot show the dilation: dilation=True says it; a live DC5 model into a plain DETR is refused.
    Nor can they show ``auxiliary_loss``, which changes transformers' function (its decoder then feeds
    each layer the LayerNorm's output and normalises the last one twice): the fixture's is told too."""
    hf_dc5.eval()
    x = torch.randn(2, 3, 64, 64)
    told = dict(encoder_attention_heads=2, decoder_attention_heads=2, auxiliary_loss=True)
    ours = fastzoo.create("detr", pretrained=hf_dc5.state_dict(), dilation=True, **told).eval()
    with torch.no_grad():
        assert (ours(pixel_values=x).logits - hf_dc5(pixel_values=x).logits).abs().max() <= OUT_TOL
    plain = fastzoo.create("detr", **{**TINY, **R18})
    with pytest.raises(CheckpointError, match="dilation: checkpoint True vs model False"):
        fastzoo.load_pretrained(plain, hf_dc5)
    hf_dc5.train()


@pytest.mark.parametrize("name,depths,dilation", [
    ("facebook/detr-resnet-50-dc5", (3, 4, 6, 3), True), ("facebook/detr-resnet-101-dc5", (3, 4, 23, 3), True),
    ("detr_resnet50_dc5", (3, 4, 6, 3), True), ("facebook/detr-resnet-50", (3, 4, 6, 3), False)])
def test_hub_names(name, depths, dilation):
    model = fastzoo.create(name, device="meta")
    assert (model.config.use_timm_backbone, model.config.depths, model.config.dilation) == (True, depths, dilation)
    conv = model.model.backbone.model.layer4[0].conv2  # a bottleneck's 3x3: the first block keeps dilation 1
    assert conv.stride == ((1, 1) if dilation else (2, 2))
    assert model.model.backbone.model.layer4[1].conv2.dilation == ((2, 2) if dilation else (1, 1))


HUB = dict(model_type="detr", backbone="resnet50", use_timm_backbone=True, num_labels=91)


@pytest.mark.parametrize("fields", [
    dict(dilation=True),  # the hub's facebook/detr-resnet-50-dc5 config.json
    dict(dilation=False),
    dict(dilation=True, backbone_kwargs={"out_indices": [1, 2, 3, 4]}),  # transformers then asks timm for its default
    dict(dilation=True, backbone_kwargs={"out_indices": [1, 2, 3, 4], "output_stride": 16}),
    dict(dilation=False, backbone_config={"model_type": "timm_backbone", "backbone": "resnet50", "output_stride": 16}),
    dict(dilation=True, backbone_config={"model_type": "timm_backbone", "backbone": "resnet50"}),
], ids=["hub-dc5", "hub-plain", "kwargs", "kwargs-os16", "config-os16", "config-plain"])
def test_config_json_reads_the_output_stride_transformers_builds(fields, monkeypatch):
    """``dilation`` is what transformers builds: the backbone_config's output stride when there is one."""
    from transformers import backbone_utils

    # transformers asks the hub whether `backbone` is a repository before a timm name with backbone_kwargs: no hub here
    monkeypatch.setattr(backbone_utils, "hf_api", lambda: types.SimpleNamespace(repo_exists=lambda name: False))
    cfg = {**HUB, **fields}
    built = transformers.DetrConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    from fastzoo.models.detr.convert import HF

    assert HF.config_from_json(cfg)["dilation"] == (built.backbone_config.output_stride == 16)


def test_transformers_resnet_backbone_has_no_dilation():
    """transformers builds its own ResNet backbone undilated whatever dilation says: fastzoo reads that
    function from such a model, and refuses to build dilation=True on that backbone."""
    from fastzoo.models.detr.config import DetrConfig
    from fastzoo.models.detr.convert import hf_config

    config = hf_config(DetrConfig.from_dict(TINY))  # the tiny config: transformers' ResNetBackbone
    config.dilation = True
    torch.manual_seed(0)
    hf = transformers.DetrForObjectDetection(config).eval()
    ours = fastzoo.create("detr", pretrained=hf).eval()
    assert not ours.config.dilation
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (ours(pixel_values=x).logits - hf(pixel_values=x).logits).abs().max() <= OUT_TOL
    with pytest.raises(ConfigError, match="dilation=True \\(DC5\\) needs use_timm_backbone=True") as e:
        fastzoo.create("detr", **TINY, dilation=True)
    assert set(e.value.fields) == {"dilation", "use_timm_backbone"}


def test_an_output_stride_detr_does_not_build_is_refused():
    from fastzoo.models.detr.convert import HF

    cfg = {**HUB, "backbone_config": {"model_type": "timm_backbone", "backbone": "resnet50", "output_stride": 8}}
    with pytest.raises(CheckpointError, match="output_stride=8"):
        HF.config_from_json(cfg)


def test_more_boxes_than_queries_equal_transformers(hf_dc5):
    ours = fastzoo.create("detr", pretrained=hf_dc5).train()
    x, mask, _ = batch(seed=2)
    compare(hf_dc5, ours, x, mask, boxes_labels([TINY["num_queries"] + 2, 1, 0]))
