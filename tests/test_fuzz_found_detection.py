"""The minimal cases the detection property (``tests/test_fuzz_detection.py``) found, each kept as an
explicit example of what it showed, now fixed."""
from __future__ import annotations

import copy

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


def test_a_channels_last_detector_is_compared_with_the_original_in_channels_last():
    """Found: Deformable DETR with ``channels_last`` (a ResNet backbone of widths 12, 16, 27, 4): fastzoo's
    logits 4.1e-4 from transformers', whose fp64 run is 1.9e-5 away. transformers' own model put in
    channels_last gives fastzoo's logits (within 1e-5) and is as far from its contiguous run: torch's CPU
    convolutions round otherwise in that layout. The property runs the original in fastzoo's layout (this
    smaller case keeps the fuzzed sizes that matter: the backbone widths, two channels)."""
    import copy

    from test_fuzz_detection import detector_step

    from fastzoo import equivalence

    spec = SPECS["deformable_detr"]
    cfg = {**spec.tiny, "num_queries": 3, "two_stage_num_proposals": 4, "layer_type": "basic",
           "hidden_sizes": (12, 16, 27, 4), "num_channels": 2, "encoder_ffn_dim": 29, "decoder_ffn_dim": 50,
           "auxiliary_loss": True, "focal_alpha": 0.225}
    torch.manual_seed(424)
    ref = spec.original.build(cfg)
    equivalence.draw_(ref, seed=424)
    ours = fastzoo.create("deformable_detr", pretrained=ref, attn="eager", channels_last=True).eval()
    ref.eval()
    in_layout = copy.deepcopy(ref).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(2)
    images = torch.randn(2, 2, 48, 40, generator=g)
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g)} for n in (1, 6)]
    plain = detector_step(ref, images, None, labels, grads=False)[0]["logits"]
    theirs = detector_step(in_layout, images.contiguous(memory_format=torch.channels_last), None, labels, grads=False)[0]["logits"]
    mine = detector_step(ours, images, None, labels, grads=False)[0]["logits"]
    # fastzoo's layout is transformers' in that layout to within a few fp32 units; the contiguous run is
    # further (4.3e-5 here, 4.1e-4 in the fuzzed case): the layout's own rounding
    assert (mine - theirs).abs().max() <= 1e-5 < (theirs - plain).abs().max()
    assert equivalence.compare_outputs("logits", mine, theirs).passed


def test_an_rt_detr_fp64_run_in_training_draws_the_denoising_noise_of_its_fp32_run():
    """Found while settling an RT-DETR decoder ``k_proj.weight`` gradient (4.47e-4 against a 3.56e-4 bound on
    sdpa-flash / varlen-cpu): in training, transformers' RT-DETR draws its denoising queries' box noise with
    ``rand_like`` of a tensor in the default dtype, which the property's fp64 run sets to fp64, and fp64's
    ``rand_like`` gives other numbers from the same seed: another function. Its gradients were 0.4-1.0 of their
    scale from the fp32 run's, and 3x that "rounding" bounded every gradient. The fp64 run now draws in fp32 and
    widens (``drawn_in_fp32``): transformers' own fp32 gradients are then 2e-5 - 6e-5 of their scale from it;
    fastzoo's pass on every backend compared below, and a gradient off by 10x the original's rounding fails."""
    from test_fuzz_detection import detector_step, original_rounding

    from fastzoo import equivalence
    from fastzoo.equivalence.exact import drawn_in_fp32

    spec = SPECS["rt_detr"]
    torch.manual_seed(0)
    ref = spec.original.build(dict(spec.tiny, dropout=0.0))
    equivalence.draw_(ref, seed=0)
    ref.train()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 64, 64, generator=g)
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.8 + 0.1}
              for n in (3, 5)]
    names = spec.converters[0].to_fastzoo
    want = names(detector_step(ref, images, None, labels, grads=True)[1])
    users, exact, _, _ = original_rounding(ref, images, None, labels)
    users, exact = [names(u) for u in users], names(exact)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # the fp64 run as it was: its own draws
        other = names(detector_step(copy.deepcopy(ref).double(), images.double(), None, labels, grads=True)[1])
    finally:
        torch.set_default_dtype(default)
    assert equivalence.grad_error(want, other) > 0.1  # another function: no measure of rounding
    own = equivalence.grad_error(want, exact)
    assert own < 1e-3, own  # the same function: transformers' fp32 rounding (6.4e-5 measured)
    with drawn_in_fp32():
        assert torch.rand_like(torch.zeros(3, dtype=torch.float64)).dtype == torch.float64
    model = fastzoo.create(spec.variants[0].name, pretrained=ref, attn="eager").train()
    for name, options in (("sdpa", {"sdpa_backend": "flash"}), ("varlen", {"impl": "cpu"})):  # the finding's backends
        model.set_attention(name, **options)
        got = detector_step(model, images, None, labels, grads=True)[1]
        part = {k: {n: r[n] for n in got} for k, r in (("want", want), ("exact", exact))}
        part["users"] = [{n: u[n] for n in got} for u in users]
        c = equivalence.compare_grads("grads", got, part["want"], kernels=part["users"], exact=part["exact"])
        assert c.passed, (name, c)
    k = "model.decoder.layers.0.self_attn.k_proj.weight"
    off = dict(got)
    rounding = max((want[k] - exact[k]).abs().max(), *((u[k] - want[k]).abs().max() for u in users),
                   equivalence.FP32_GRAD_RTOL * want[k].abs().max())  # the original's own, at least the fixed bound
    off[k] = want[k] + 10 * rounding * torch.sign(torch.randn_like(want[k]))
    assert not equivalence.compare_grads("grads", off, part["want"], kernels=part["users"], exact=part["exact"]).passed


def test_a_detectors_eager_attention_rounds_as_transformers_eager_attention():
    """Found by the detection property (long profile) on RF-DETR in eval mode: on fastzoo's eager backend the
    gradient of ``decoder.layers.1.layer_norm.weight`` was 1.64e-3 of its scale from transformers', past 3x
    transformers' own rounding (4.45e-4 between its eager and SDPA runs; 2.6e-4 from its fp64 run). RF-DETR's boxes
    pass through three exp() in a row (gradients up to 2.6e5 there), which amplify any difference of rounding, and
    there was one: fastzoo's eager attention scaled q before the product q k^T (timm's order) where transformers'
    scales the product, and for a head width whose scale is no power of two (8 here) the two round otherwise
    (7e-6 in the backbone's features). A layer whose original scales the product says so (``scale_scores``): the
    DETR family's attention and RF-DETR's DINOv2. On transformers' own deformable path (``reference``) fastzoo's
    eager RF-DETR now computes transformers' numbers to the last bit, through the three exp() too."""
    from fastzoo import equivalence

    spec = SPECS["rf_detr"]
    cfg = {**spec.tiny, "decoder_self_attention_heads": 4}  # head width 8 in the backbone and in the decoder
    torch.manual_seed(3)
    ref = spec.original.build(cfg).eval()
    equivalence.draw_(ref, seed=3)
    ours = fastzoo.create(spec.variants[0].name, pretrained=ref, attn="eager").eval().set_deformable_attention("reference")
    images = torch.randn(2, 3, 32, 40, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs, mine = ref(pixel_values=images), ours(pixel_values=images)
    for k in ("backbone_features", "enc_outputs_coord_logits", "logits", "pred_boxes"):
        a, b = (o[k][0] if isinstance(o[k], (list, tuple)) else o[k] for o in (theirs, mine))
        assert torch.equal(a, b), (k, (a - b).abs().max())
    assert theirs.pred_boxes.abs().max() > 2  # boxes grown by the exp() of drawn deltas: the amplifying case


def test_rf_detrs_dinov2_projects_q_k_v_apart_as_transformers_does():
    """Found by the detection property (long profile, shrunk): an RF-DETR whose DINOv2 is 4 wide (2 heads of 2), in
    training on one image without boxes: on fastzoo's eager backend the class token's gradient was 4.55e-4 of its
    scale from transformers', past 3x transformers' own rounding (7.9e-5 from its fp64 run); the gradient cancels
    (1.3% of the largest). fastzoo's ViT block projects q, k and v in one product with ``qkv`` (timm's), whose
    backward sums the input's gradient over the three in one accumulation; transformers' DINOv2 has three
    projections and sums three products. RF-DETR's blocks project apart (``split_qkv``, the same weights): 5.1e-6."""
    from fuzzing import non_default
    from test_fuzz_detection import detector_step, original_rounding

    from fastzoo import equivalence

    spec = SPECS["rf_detr"]
    cfg = {**spec.tiny, "hidden_size": 4, "num_attention_heads": 2, "layerscale_value": 1.0930589056890703,
           "backbone_out_indices": (2, 3, 5), "backbone_layer_norm_eps": 0.0008322518243670218,
           "hidden_expansion": 0.8153875883830117, "activation_function": "silu", "layer_norm_eps": 1.8109653060617223e-144,
           "decoder_layers": 1, "decoder_self_attention_heads": 1, "decoder_cross_attention_heads": 1, "decoder_n_points": 1,
           "class_cost": 3.695584935733927, "bbox_cost": 9.578967400496216, "giou_cost": 2.9581173769860585,
           "class_loss_coefficient": 0.023841042643107276, "bbox_loss_coefficient": 8.696155124755593,
           "giou_loss_coefficient": 0.7506461220029907, "giou_impl": "per_sample"}
    torch.manual_seed(1212)
    ref = spec.original.build(non_default(spec, cfg)).train()
    equivalence.draw_(ref, seed=1212)
    images = torch.randn(1, 3, 48, 32, generator=torch.Generator().manual_seed(172))
    labels = [{"class_labels": torch.zeros(0, dtype=torch.long), "boxes": torch.zeros(0, 4)}]
    names = spec.converters[0].to_fastzoo
    want = names(detector_step(ref, images, None, labels, grads=True)[1])
    users, exact, _, _ = original_rounding(ref, images, None, labels)
    users, exact = [names(u) for u in users], names(exact)
    ours = fastzoo.create(spec.variants[0].name, pretrained=ref, attn="eager").train()
    blocks = [b.attn for b in ours.model.backbone.backbone.blocks]
    assert all(a.split_qkv for a in blocks)
    verdicts = {}
    for split in (True, False):  # transformers' three products; timm's one (the finding)
        for a in blocks:
            a.split_qkv = split
        got = detector_step(ours, images, None, labels, grads=True)[1]
        verdicts[split] = equivalence.compare_grads("grads", got, {k: want[k] for k in got}, kernels=[{k: u[k] for k in got} for u in users],
                                                    exact={k: exact[k] for k in got})
    assert verdicts[True].passed and verdicts[True].err < 2e-5, verdicts[True]  # 5.1e-6 measured
    # the one product: 1.9x its bound here (89x the three products' error); a margin, not an equality of roundings
    assert verdicts[False].err > 10 * verdicts[True].err, verdicts
