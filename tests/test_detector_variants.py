"""The detector variants (transformers' hub ids) against the checkpoints they name, without the hub: each
variant's config, as transformers' config it builds, equals the one transformers' conversion script writes
for that checkpoint, field for field; its parameter count is the one its authors publish.

The conversion scripts' configs are restated here (not imported: the scripts download at import), each
function naming its script in huggingface/transformers (src/transformers/models/<family>/...). Every
field of the two transformers configs is compared (``to_dict``, the backbone's included), so a size, a
depth, a class count or a flag typed wrong in a spec fails here; tests/test_registry.py checks that
fastzoo's network has transformers' parameter count for the same config."""
from __future__ import annotations

import pytest
import transformers

import fastzoo
from fastzoo.models.d_fine.convert import hf_config as d_fine_hf_config
from fastzoo.models.deformable_detr.convert import hf_config as deformable_detr_hf_config
from fastzoo.models.rf_detr.convert import hf_config as rf_detr_hf_config
from fastzoo.models.rt_detr.convert import hf_config as rt_detr_hf_config
from fastzoo.registry import get_entry, specs

HF_CONFIG = {"rt_detr": rt_detr_hf_config, "d_fine": d_fine_hf_config, "rf_detr": rf_detr_hf_config,
             "deformable_detr": deformable_detr_hf_config}
VARIANTS = [v.name for s in specs() if s.family in HF_CONFIG for v in s.variants]


# -- rt_detr/convert_rt_detr_original_pytorch_checkpoint_to_hf.py (get_rt_detr_config) and
# -- rt_detr_v2/convert_rt_detr_v2_original_pytorch_checkpoint_to_hf.py (get_rt_detr_v2_config): the same sizes
def _rt_detr(depth: str, v2: bool):
    config = (transformers.RTDetrV2Config if v2 else transformers.RTDetrConfig)()
    config.num_labels = 80
    if depth in ("r18vd", "r34vd"):
        config.backbone_config.hidden_sizes = [64, 128, 256, 512]
        config.backbone_config.depths = [2, 2, 2, 2] if depth == "r18vd" else [3, 4, 6, 3]
        config.backbone_config.layer_type = "basic"
        config.encoder_in_channels = [128, 256, 512]
        config.hidden_expansion = 0.5
        config.decoder_layers = 3 if depth == "r18vd" else 4
    elif depth == "r101vd":
        config.backbone_config.depths = [3, 4, 23, 3]
        config.encoder_ffn_dim = 2048
        config.encoder_hidden_dim = 384
        config.decoder_in_channels = [384, 384, 384]
    return config


# -- d_fine/convert_d_fine_original_pytorch_checkpoint_to_hf.py (get_d_fine_config)
def _d_fine(size: str):
    config = transformers.DFineConfig()
    config.num_labels = 80
    bb = config.backbone_config
    bb.hidden_sizes, bb.layer_type, bb.embedding_size = [64, 128, 256, 512], "basic", 32
    config.hidden_expansion, config.decoder_layers = 1.0, 6
    bb.stage_downsample, bb.stage_light_block = [False, True, True, True], [False, False, True, True]
    bb.stage_kernel_size = [3, 3, 5, 5]
    config.decoder_n_points = [3, 6, 3]
    if size == "xlarge":
        bb.hidden_sizes = [256, 512, 1024, 2048]
        bb.stem_channels, bb.stage_in_channels = [3, 32, 64], [64, 128, 512, 1024]
        bb.stage_mid_channels, bb.stage_out_channels = [64, 128, 256, 512], [128, 512, 1024, 2048]
        bb.stage_num_blocks, bb.stage_numb_of_layers = [1, 2, 5, 2], [6, 6, 6, 6]
        config.encoder_in_channels, config.encoder_hidden_dim = [512, 1024, 2048], 384
        config.encoder_ffn_dim, config.decoder_in_channels = 2048, [384, 384, 384]
    elif size == "medium":
        bb.hidden_sizes = [192, 384, 768, 1536]
        bb.stem_channels, bb.stage_in_channels = [3, 24, 32], [32, 96, 384, 768]
        bb.stage_mid_channels, bb.stage_out_channels = [32, 64, 128, 256], [96, 384, 768, 1536]
        bb.stage_num_blocks, bb.stage_numb_of_layers = [1, 1, 3, 1], [4, 4, 4, 4]
        config.decoder_layers, config.encoder_in_channels = 4, [384, 768, 1536]
        bb.use_learnable_affine_block, config.depth_mult = True, 0.67
    elif size == "large":
        bb.hidden_sizes = [256, 512, 1024, 2048]
        bb.stem_channels, bb.stage_in_channels = [3, 32, 48], [48, 128, 512, 1024]
        bb.stage_mid_channels, bb.stage_out_channels = [48, 96, 192, 384], [128, 512, 1024, 2048]
        bb.stage_num_blocks, bb.stage_numb_of_layers = [1, 1, 3, 1], [6, 6, 6, 6]
        config.encoder_ffn_dim, config.encoder_in_channels = 1024, [512, 1024, 2048]
    else:  # small
        bb.hidden_sizes = [128, 256, 512, 1024]
        bb.stem_channels, bb.stage_in_channels = [3, 16, 16], [16, 64, 256, 512]
        bb.stage_mid_channels, bb.stage_out_channels = [16, 32, 64, 128], [64, 256, 512, 1024]
        bb.stage_num_blocks, bb.stage_numb_of_layers = [1, 1, 2, 1], [3, 3, 3, 3]
        config.decoder_layers, config.hidden_expansion, config.depth_mult = 3, 0.5, 0.34
        config.encoder_in_channels, bb.use_learnable_affine_block = [256, 512, 1024], True
    return config


# -- rf_detr/convert_rf_detr_weights_to_hf.py (BACKBONE_CONFIGS, MODEL_CONFIGS, get_model_config); its
# -- sizes are those of rf_detr/convert_rf_detr_to_hf.py's OBJECT_DETECTION_CHECKPOINT_DEFAULT_ARGS
def _rf_detr(size: str):
    backbone = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, image_size=384,
                    patch_size=16, num_windows=2, out_indices=[3, 6, 9, 12], layer_norm_eps=1e-6, qkv_bias=True)
    backbone.update({"small": dict(image_size=512), "medium": dict(image_size=576), "large": dict(image_size=704),
                     "base": dict(image_size=518, patch_size=14, num_windows=4, out_indices=[2, 5, 8, 11]),
                     }.get(size, {}))
    layers = {"nano": 2, "small": 3, "base": 3, "medium": 4, "large": 4}[size]
    return transformers.RfDetrConfig(backbone_config=dict(backbone, model_type="rf_detr_dinov2"), d_model=256,
                                     num_queries=300, decoder_self_attention_heads=8, decoder_cross_attention_heads=16,
                                     decoder_n_points=2, decoder_layers=layers, num_labels=91)


# -- deformable_detr/convert_deformable_detr_to_pytorch.py (convert_deformable_detr_checkpoint); its settings
# -- given to the constructor, which derives the timm backbone's stages from num_feature_levels (C5 alone for one)
def _deformable_detr(single_scale=False, with_box_refine=False, two_stage=False):
    return transformers.DeformableDetrConfig(num_feature_levels=1 if single_scale else 4, num_labels=91,
                                             with_box_refine=with_box_refine, two_stage=two_stage)


SCRIPT = {
    **{f"rtdetr_{d}{o}": (lambda d=d: _rt_detr(d, v2=False))  # the script converts no r34vd_coco_o365
       for d in ("r18vd", "r34vd", "r50vd", "r101vd") for o in ("", "_coco_o365") if f"{d}{o}" != "r34vd_coco_o365"},
    **{f"rtdetr_v2_{d}": (lambda d=d: _rt_detr(d, v2=True)) for d in ("r18vd", "r34vd", "r50vd", "r101vd")},
    **{f"dfine_{s}_{data}": (lambda s=s: _d_fine(s))
       for s in ("small", "medium", "large", "xlarge") for data in ("coco", "obj2coco")},
    **{f"rf_detr_{s}": (lambda s=s: _rf_detr(s)) for s in ("nano", "small", "base", "medium", "large")},
    "deformable_detr": _deformable_detr,
    "deformable_detr_single_scale": lambda: _deformable_detr(single_scale=True),
    "deformable_detr_box_refine": lambda: _deformable_detr(with_box_refine=True),
    "deformable_detr_two_stage": lambda: _deformable_detr(with_box_refine=True, two_stage=True),
}
# D-FINE-X's decoder curvature: the script keeps DFineConfig's reg_scale 4.0 while the checkpoint's tensor
# (model.decoder.reg_scale, loaded over the config's value) holds the D-FINE repository's 8
# (configs/dfine/dfine_hgnetv2_x_coco.yml: DFINETransformer.reg_scale: 8); fastzoo's config states the weights'
WEIGHTS_OVER_SCRIPT = {f"dfine_xlarge_{data}": {"reg_scale": (4.0, 8.0)} for data in ("coco", "obj2coco")}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("id2label", "label2id"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


# HGNetV2Config's ResNet-style fields that transformers' HGNetV2 does not build from (its stages are the stage_*
# fields): the script sets them loosely (embedding_size 32, layer_type "basic", hidden_sizes whose first entry is
# not the first stage's width); of hidden_sizes the network reads only the backbone's output stages' widths
# (the encoder's input projections), those checked apart; and transformers' legacy training switch, which
# fastzoo's D-FINE config writes (False) and DFineConfig lacks
UNREAD = {"d_fine": {"backbone_config.embedding_size", "backbone_config.layer_type", "backbone_config.depths",
                     "backbone_config.hidden_sizes", "gradient_checkpointing"}}


def _differences(script, ours, unread=frozenset()) -> dict:
    a, b = _flat(script.to_dict()), _flat(ours.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in unread}


def test_every_detector_variant_has_its_conversion_script():
    assert sorted(SCRIPT) == sorted(VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_config_is_the_conversion_scripts(name):
    entry = get_entry(name)
    family, script = entry.spec.family, SCRIPT[name]()
    ours = HF_CONFIG[family](entry.spec.config_class.from_dict(entry.config))
    assert _differences(script, ours, UNREAD.get(family, frozenset())) == WEIGHTS_OVER_SCRIPT.get(name, {})
    if family == "d_fine":  # the widths the encoder's input projections read
        outs = ours.backbone_config.out_indices
        assert outs == script.backbone_config.out_indices == [2, 3, 4]
        assert [ours.backbone_config.hidden_sizes[i - 1] for i in outs] == \
               [script.backbone_config.hidden_sizes[i - 1] for i in outs] == list(script.encoder_in_channels)


# Published parameter counts (millions) and the precision they are given to: a count is the authors' within
# 2% plus half its last published digit (a table's "42" is anything in [41.5, 42.5)).
RT_DETR_PAPER = "RT-DETR, arXiv:2304.08069, Table 2 (and lyuwenyu/RT-DETR's README)"
RT_DETR_V2_README = "lyuwenyu/RT-DETR rtdetrv2_pytorch/README.md (RT-DETRv2 S / M* / L / X)"
D_FINE_README = "github.com/Peterande/D-FINE README.md (D-FINE-S / M / L / X)"
RF_DETR_TABLE = "rfdetr.roboflow.com/latest/learn/benchmarks (detection table, Params (M))"
DEFORMABLE_PAPER = "Deformable DETR, arXiv:2010.04159, Table 1"
PUBLISHED = {
    "rtdetr_r18vd": (20, 1, RT_DETR_PAPER), "rtdetr_r34vd": (31, 1, RT_DETR_PAPER),
    "rtdetr_r50vd": (42, 1, RT_DETR_PAPER), "rtdetr_r101vd": (76, 1, RT_DETR_PAPER),
    "rtdetr_v2_r18vd": (20, 1, RT_DETR_V2_README), "rtdetr_v2_r34vd": (31, 1, RT_DETR_V2_README),
    "rtdetr_v2_r50vd": (42, 1, RT_DETR_V2_README), "rtdetr_v2_r101vd": (76, 1, RT_DETR_V2_README),
    "dfine_small_coco": (10, 1, D_FINE_README), "dfine_medium_coco": (19, 1, D_FINE_README),
    "dfine_large_coco": (31, 1, D_FINE_README), "dfine_xlarge_coco": (62, 1, D_FINE_README),
    "rf_detr_nano": (30.5, 0.1, RF_DETR_TABLE), "rf_detr_small": (32.1, 0.1, RF_DETR_TABLE),
    "rf_detr_medium": (33.7, 0.1, RF_DETR_TABLE), "rf_detr_large": (33.9, 0.1, RF_DETR_TABLE),
    "deformable_detr": (40, 1, DEFORMABLE_PAPER), "deformable_detr_single_scale": (34, 1, DEFORMABLE_PAPER),
}
# not listed: rf_detr_base (the benchmarks table lists Nano to Large only; RFDETRBase is legacy there), the
# Objects365-pretrained checkpoints (their configs equal the COCO ones, above), Deformable DETR's refinement variants
# RF-DETR-L counted to the parameter: roboflow/model-leaderboard,
# models/object_detection/rf-detr/results_RF-DETR-L.json, metadata.param_count
RF_DETR_L_EXACT = 33_933_218


def _parameters(name: str) -> int:
    return sum(p.numel() for p in fastzoo.create(name, device="meta").parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
    millions, unit, source = PUBLISHED[name]
    ours = _parameters(name) / 1e6
    assert abs(ours - millions) <= 0.02 * millions + unit / 2, f"{name}: {ours:.3f}M, {source}: {millions}M"


def test_rf_detr_large_has_the_leaderboards_exact_count():
    assert _parameters("rf_detr_large") == RF_DETR_L_EXACT
