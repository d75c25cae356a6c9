"""DETR read as transformers' user reads it: ``DetrConfig``'s field names (``backbone`` is timm's model
name, ``use_timm_backbone`` the choice of ResNet module), a fresh model initialised as transformers',
``forward`` with transformers 5.17's keywords in its order and every input it does not serve refused by
name, the GIoU implementation under one name, a missing key named, and eval mode after loading as
``from_pretrained``."""
import inspect

import pytest
import torch
import transformers
from conftest import SPECS

import fastzoo
from fastzoo.errors import CheckpointError, ConfigError
from fastzoo.losses.registry import get_loss
from fastzoo.losses.set_prediction import GIOU_IMPLS, set_prediction_loss

TINY = SPECS["detr"].tiny


def test_backbone_is_timms_model_name_as_transformers_detr_config():
    model = fastzoo.create("detr", backbone="resnet18")
    cfg = model.config
    assert (cfg.use_timm_backbone, cfg.backbone, cfg.layer_type, cfg.depths) == (True, "resnet18", "basic", (2, 2, 2, 2))
    assert model.hf_config().backbone_config.backbone == "resnet18"
    assert fastzoo.create("detr", pretrained=model).config.backbone == "resnet18"
    assert fastzoo.create("detr").config.backbone == "resnet50"  # transformers' DetrConfig() default


def test_sizes_that_contradict_the_named_backbone_are_refused_naming_both():
    with pytest.raises(ConfigError, match="depths=.*resnet18") as e:
        fastzoo.create("detr", backbone="resnet18", depths=(1, 1, 1, 1))
    assert set(e.value.fields) == {"depths", "backbone"}
    with pytest.raises(ConfigError, match="use_timm_backbone=False") as e:
        fastzoo.create("detr", **{**TINY, "backbone": "resnet18"})
    assert set(e.value.fields) == {"backbone", "use_timm_backbone"}


def test_fresh_init_is_transformers_init_on_both_backbones():
    """timm's ResNet starts with each block's last BatchNorm weight at 0 (timm's zero_init_last), as
    transformers builds it; transformers' own ResNet with kaiming-normal (fan out) convolutions."""
    torch.manual_seed(0)
    timm_path = fastzoo.create("detr", backbone="resnet18").model.backbone.model
    ref = SPECS["detr"].original.build({"backbone": "resnet18"}).model.backbone.model
    for i in range(1, 5):
        for j in range(2):
            ours_bn, ref_bn = getattr(timm_path, f"layer{i}")[j].bn2.weight, getattr(ref, f"layer{i}")[j].bn2.weight
            assert torch.equal(ours_bn, ref_bn) and not ours_bn.any()
    hf_path = fastzoo.create("detr", **TINY).model.backbone.model
    conv = hf_path.encoder.stages[3].layers[0].layer[0].convolution.weight  # 1x1, 32 -> 8 channels: fan out 8
    # kaiming normal, fan out: std sqrt(2 / 8) = 0.5 over 256 values (PyTorch's default init: std 0.10)
    assert 0.4 < conv.std().item() < 0.6


def test_forward_signature_is_transformers():
    ours = list(inspect.signature(SPECS["detr"].model.forward).parameters)
    theirs = list(inspect.signature(transformers.DetrForObjectDetection.forward).parameters)
    assert ours == theirs


@pytest.mark.parametrize("keyword, value", [
    ("decoder_attention_mask", torch.ones(1, 8)), ("encoder_outputs", (torch.zeros(1, 4, 32),)),
    ("inputs_embeds", torch.zeros(1, 4, 32)), ("decoder_inputs_embeds", torch.zeros(1, 8, 32)),
    ("output_attentions", True), ("output_hidden_states", True), ("made_up_keyword", 1), ("made_up_keyword", None),
])
def test_an_input_detr_does_not_serve_is_refused_by_name(keyword, value):
    model = fastzoo.create("detr", **TINY).eval()
    with pytest.raises(ValueError, match=f"^{keyword}="):
        model(pixel_values=torch.randn(1, 3, 64, 64), **{keyword: value})


def test_keywords_transformers_trainer_passes_run_as_transformers():
    """``labels`` in transformers' place (after the four keywords it refuses), ``return_dict=False``
    a tuple, ``num_items_in_batch`` changes nothing (transformers' DETR loss normalises by the boxes)."""
    model = fastzoo.create("detr", **TINY, dropout=0.0).eval()
    x = torch.randn(1, 3, 64, 64)
    labels = [{"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}]
    with torch.no_grad():
        out = model(x, None, None, None, None, None, labels)
        same = model(pixel_values=x, labels=labels, num_items_in_batch=7, return_dict=False)
    assert out.loss is not None and torch.equal(out.loss, same[0])


def test_the_giou_implementation_has_one_name_across_config_loss_and_declaration():
    assert fastzoo.create("detr", **TINY, giou_impl="concat").config.giou_impl == "concat"
    assert tuple(get_loss("set_prediction").impls) == tuple(GIOU_IMPLS)
    assert "giou_impl" in inspect.signature(set_prediction_loss).parameters
    with pytest.raises(ValueError, match="giou_impl='fast'"):
        set_prediction_loss(torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2, 4), 0.5), [{"class_labels": torch.tensor([0]),
                            "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}], giou_impl="fast")
    for old in ("loss", "backbone_impl"):
        with pytest.raises(Exception, match=old):
            fastzoo.create("detr", **TINY, **{old: "kernel"})


def test_a_state_dict_missing_one_key_is_refused_naming_the_key():
    model = fastzoo.create("detr", **TINY)
    for key in ("model.encoder.layers.0.mlp.fc1.bias", "class_labels_classifier.weight",
                "model.query_position_embeddings.weight"):
        state = {k: v for k, v in model.state_dict().items() if k != key}
        with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
            fastzoo.create("detr", pretrained=state, **TINY)


@pytest.mark.parametrize("source", ["live", "directory", "state_dict"])
def test_a_transformers_checkpoint_comes_back_in_eval_mode_as_from_pretrained(source, tmp_path):
    """Dropout off after loading: two forwards of one image give the same logits."""
    hf = SPECS["detr"].original.build(dict(TINY))
    if source == "directory":
        hf.save_pretrained(tmp_path)
    src = {"live": hf, "directory": tmp_path, "state_dict": hf.state_dict()}[source]
    ours = fastzoo.create("detr", pretrained=src, **({} if source != "state_dict" else TINY))
    assert not ours.training
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(pixel_values=x).logits, ours(pixel_values=x).logits)
    assert fastzoo.create("detr", **TINY).training  # a fresh model trains, as transformers' DetrForObjectDetection(config)
