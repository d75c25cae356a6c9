"""The minimal cases the detection property (``tests/test_fuzz_detection.py``) found, each kept as an
explicit example of what it showed, now fixed."""
from __future__ import annotations

import torch
from conftest import SPECS

import fastzoo


def test_a_deformable_detr_stem_has_the_channels_of_its_backbone_config():
    """Found: Deformable DETR with ``num_channels=1`` on a timm backbone. transformers'
    ``DeformableDetrConfig`` builds its timm backbone with 3 input channels whatever ``num_channels``
    says (``DetrConfig`` passes ``num_channels`` on): fastzoo read ``num_channels`` from the top-level
    field and refused to load the 3-channel stem. The stem's channels are the backbone config's, read
    from it; and a fastzoo config with one channel is written with a backbone config of one channel."""
    import transformers

    kw = dict(use_timm_backbone=True, backbone="resnet18", num_channels=1, d_model=32, encoder_layers=2, decoder_layers=2,
              encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2, num_queries=4)
    hf = transformers.DeformableDetrForObjectDetection(transformers.DeformableDetrConfig(**kw))
    stem = hf.model.backbone.model.conv1.weight
    assert stem.shape[1] == 3  # transformers' own function: 3-channel images
    ours = fastzoo.create("deformable_detr", pretrained=hf, attn="eager")
    assert ours.config.num_channels == 3
    assert torch.equal(ours.state_dict()["model.backbone.model.conv1.weight"], stem)

    spec = SPECS["deformable_detr"]
    cfg = {**spec.tiny, "num_channels": 1, "use_timm_backbone": True, "backbone": "resnet18", "layer_type": "basic",
           "depths": (2, 2, 2, 2), "hidden_sizes": (64, 128, 256, 512), "embedding_size": 64}
    original = spec.original.build(cfg)
    assert original.model.backbone.model.conv1.weight.shape[1] == 1
    assert fastzoo.create("deformable_detr", pretrained=original, attn="eager").config.num_channels == 1
