"""RT-DETR and RT-DETRv2 against transformers' RTDetrForObjectDetection / RTDetrV2ForObjectDetection on the same
weights, every parameter and buffer drawn (`fastzoo.equivalence.weights.draw_`): logits, boxes, the encoder's
query selection in eval mode; in train mode with labels, the denoising queries drawn from the same seed (the
groups, their boxes and the RNG left as transformers leaves it), every per-layer output and parameter gradient,
and the loss (every loss_dict term, in every GIoU mode) with its gradients; for every CPU attention backend of
the self-attentions and every deformable attention kernel serving the CPU; v1 and v2 (bilinear and discrete
sampling, more decoder levels than encoder maps), bottleneck and basic ResNet-vd, pre-norm AIFI; checkpoints
both ways; gradient checkpointing and what transformers' Trainer reads; config errors by name."""
import copy
import re

import pytest
import torch
from conftest import SPECS, backends, cuda_only
from detection_checks import backward, boxes_labels, failures, grads, labels_in, read_back
from detection_checks import compare_eval as check_eval
from detection_checks import compare_loss_path as check_loss_path

import fastzoo
from fastzoo.attention.deformable import available
from fastzoo.equivalence.rule import compare_grads, compare_outputs
from fastzoo.equivalence.weights import draw_
from fastzoo.errors import ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS

TINY = dict(SPECS["rt_detr"].tiny)
V2 = dict(model_type="rt_detr_v2")
CASES = {
    "v1": {},
    "v1_bottleneck_prenorm": dict(layer_type="bottleneck", hidden_sizes=(16, 32, 48, 64), encoder_in_channels=(32, 48, 64),
                                  normalize_before=True, hidden_expansion=0.5, encoder_layers=2),
    "v2": V2,
    "v2_discrete_4_levels": dict(V2, decoder_method="discrete", num_feature_levels=4, decoder_n_levels=4,
                                 decoder_offset_scale=0.7),
}
IMPLS = available(torch.device("cpu"), torch.float32, backward=True)


def original(**overrides):
    torch.manual_seed(0)
    return draw_(SPECS["rt_detr"].original.build({**TINY, **overrides})).train()


def batch(seed=0, counts=(2, 0, 5)):
    """3 images of 64 x 96 (RT-DETR's maps halve exactly: sides a multiple of the coarsest stride, 32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, 64, 96, generator=g), boxes_labels(counts, TINY["num_labels"], torch.Generator().manual_seed(seed))


def run_inner(model, x, labels, seed):
    """The detector's inner model in train mode on ``labels`` (denoising queries drawn after ``seed``):
    per-layer logits and boxes, the encoder's top-k, the denoising meta, and the RNG's next draw."""
    torch.manual_seed(seed)
    if isinstance(model, fastzoo.models.rt_detr.RTDetrForObjectDetection):
        o = model.model(x, labels)
        meta = o["dn"].meta if o["dn"] is not None else None
        out = dict(logits=o["logits"], boxes=o["boxes"], enc_topk_logits=o["enc_topk_logits"],
                   enc_topk_bboxes=o["enc_topk_bboxes"], init_ref=o["init_ref"])
    else:
        o = model.model(pixel_values=x, labels=labels)
        meta = o.denoising_meta_values
        out = dict(logits=o.intermediate_logits, boxes=o.intermediate_reference_points, enc_topk_logits=o.enc_topk_logits,
                   enc_topk_bboxes=o.enc_topk_bboxes, init_ref=o.init_reference_points)
    return out, meta, torch.rand(4)


def synthetic_loss(out: dict, seed=0) -> torch.Tensor:
    """A scalar reaching every output through fixed random weights (every layer, every query, the
    encoder's top-k), so each parameter's gradient is compared."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g).to(t.device)).sum() for k, t in sorted(out.items()) if k != "init_ref")


def compare_train(hf, ours, x, labels, seed=0):
    """fastzoo.equivalence's fp32 rule: outputs 1e-4 absolute (or 8 ulps of their scale), gradients 1e-4 of their
    scale (or 3x the original's own fp32 rounding against its fp64 run, where larger); the denoising groups
    and the RNG's next draw exactly equal (the same calls in the same order)."""
    o1, m1, next1 = run_inner(hf, x, labels, seed)
    o2, m2, next2 = run_inner(ours, x, labels, seed)
    assert torch.equal(next1, next2)  # the same random numbers consumed
    assert (m1 is None) == (m2 is None)
    if m1 is not None:
        assert m1["dn_num_group"] == m2["dn_num_group"] and m1["dn_num_split"] == m2["dn_num_split"]
        assert all(torch.equal(a, b) for a, b in zip(m1["dn_positive_idx"], m2["dn_positive_idx"], strict=True))
    checks = [compare_outputs(k, o2[k], o1[k]) for k in o1]
    backward(hf, ours, synthetic_loss(o1), synthetic_loss(o2))
    g1, g2 = grads(hf.model), grads(ours.model)
    assert len(g1) > 80 and set(g1) == set(g2)
    exact = _fp64_grads(hf, x, labels, seed)
    checks.append(compare_grads("grads", g2, g1, exact=exact))
    assert not failures(checks), failures(checks)


def _fp64_grads(hf, x, labels, seed) -> dict:
    other = copy.deepcopy(hf).double()
    out, _, _ = run_inner(other, x.double(), labels_in(labels, torch.float64), seed)
    synthetic_loss(out).backward()
    return {n: g.float() for n, g in grads(other.model).items()}


def compare_eval(hf, ours, x):
    check_eval(hf, ours, x, ("logits", "pred_boxes", "enc_topk_logits", "enc_topk_bboxes", "enc_outputs_class",
                             "enc_outputs_coord_logits", "intermediate_hidden_states"))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, original(**CASES[request.param])


def test_eval_mode_equal_to_transformers(case):
    _, hf = case
    ours = fastzoo.create(pretrained=hf)
    assert not ours.training  # as transformers' from_pretrained gives it
    compare_eval(hf, ours, batch()[0])


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_train_mode_with_denoising_equal_to_transformers_for_every_backend(case, attn):
    _, hf = case
    backend, options = attn
    ours = fastzoo.create(pretrained=hf).set_attention(backend, **options).train()
    x, labels = batch()
    compare_train(hf, ours, x, labels)


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_to_transformers_for_every_deformable_kernel(impl):
    hf = original(**CASES["v1"])
    ours = fastzoo.create(pretrained=hf).set_deformable_attention(impl).train()
    x, labels = batch(seed=2)
    compare_train(hf, ours, x, labels)
    compare_eval(hf, ours, x)


def test_more_boxes_than_denoising_queries_and_no_boxes_equal_transformers():
    """More boxes than num_denoising (one group), and a batch without a box (no denoising queries)."""
    hf = original(**CASES["v2"])
    ours = fastzoo.create(pretrained=hf).train()
    x, labels = batch(seed=3, counts=(TINY["num_denoising"] + 3, 1, 0))
    compare_train(hf, ours, x, labels)
    x, labels = batch(seed=4, counts=(0, 0, 0))
    compare_train(hf, ours, x, labels)


def test_the_same_seed_gives_the_same_denoising_groups_and_another_seed_others():
    hf = original()
    ours = fastzoo.create(pretrained=hf).train()
    x, labels = batch(seed=5)
    with torch.no_grad():
        refs = [run_inner(m, x, labels, seed)[0]["init_ref"] for m in (hf, ours) for seed in (7, 8)]
    n = 2 * 5 * (TINY["num_denoising"] // 5)  # twice the most boxes per group, num_denoising // most groups
    assert torch.equal(refs[0][:, :n], refs[2][:, :n])  # seed 7: the same noisy boxes, bit for bit
    assert torch.equal(refs[1][:, :n], refs[3][:, :n])
    assert not torch.equal(refs[0][:, :n], refs[1][:, :n])  # another seed draws other boxes


@pytest.mark.parametrize("over", [dict(eval_size=640), dict(anchor_image_size=(64, 96))], ids=["eval_size", "anchors"])
def test_eval_size_and_anchor_image_size_equal_transformers(over):
    """eval_size: transformers drops AIFI's position embedding in eval mode; anchor_image_size: eval mode's
    anchors from the configured size."""
    hf = original(**over)
    ours = fastzoo.create(pretrained=hf)
    compare_eval(hf, ours, batch(seed=6)[0])


def test_images_off_the_anchor_image_size_are_refused_in_eval_mode_naming_them():
    """Eval mode's anchors are anchor_image_size's: another token count fails inside transformers (a size
    mismatch); fastzoo names it. Train mode takes each batch's own maps; an anchor size below the coarsest
    stride (maps of no position) is refused at config."""
    ours = fastzoo.create("rtdetr_r50vd", **{**TINY, "anchor_image_size": (64, 96)}).eval()
    with pytest.raises(ValueError, match=r"pixel_values: .*anchor_image_size=\(64, 96\)"):
        ours(pixel_values=torch.randn(1, 3, 64, 64))
    assert ours.train()(pixel_values=torch.randn(2, 3, 64, 64)).logits.isfinite().all()
    with pytest.raises(ConfigError, match="anchor_image_size") as e:
        fastzoo.create("rtdetr_r50vd", device="meta", **{**TINY, "anchor_image_size": (16, 96)})
    assert "anchor_image_size" in e.value.fields


@pytest.mark.parametrize("name", ["v1", "v2_discrete_4_levels"])
def test_save_pretrained_round_trips_with_transformers(tmp_path, name):
    """Written by fastzoo, read by transformers (and back by fastzoo), in eval mode as transformers loads."""
    import transformers

    hf = original(**CASES[name])
    cls = transformers.RTDetrV2ForObjectDetection if name.startswith("v2") else transformers.RTDetrForObjectDetection
    _, again = read_back(hf, fastzoo.create(pretrained=hf), tmp_path, cls, pixel_values=batch(seed=7)[0])
    assert again.config.model_type == hf.config.model_type


@pytest.mark.parametrize("name", ["v1_bottleneck_prenorm", "v2_discrete_4_levels"])
def test_a_bare_state_dict_gives_its_architecture(name):
    """From the keys alone: the backbone, the encoder's maps and layers, the levels, v1 or v2 (heads, points
    and functions the tensors cannot show are given, as a user gives a tiny model's)."""
    hf = original(**CASES[name])
    given = {k: v for k, v in {**TINY, **CASES[name]}.items()
             if k in ("encoder_attention_heads", "decoder_attention_heads", "decoder_n_points", "num_queries",
                      "num_denoising", "normalize_before", "decoder_method", "decoder_offset_scale")}
    ours = fastzoo.create("rtdetr_r50vd", pretrained=hf.state_dict(), **given)
    made = fastzoo.create("rtdetr_r50vd", **{**TINY, **CASES[name]}).config
    for field in ("model_type", "layer_type", "depths", "hidden_sizes", "embedding_size", "backbone_out_indices",
                  "encoder_in_channels", "encoder_hidden_dim", "encoder_layers", "hidden_expansion", "d_model",
                  "decoder_layers", "num_feature_levels", "decoder_n_levels"):
        assert getattr(ours.config, field) == getattr(made, field), field
    compare_eval(hf, ours, batch(seed=8)[0])


@pytest.mark.parametrize("bad, field", [
    (dict(learn_initial_query=True), "learn_initial_query"),
    (dict(encoder_in_channels=(16, 24)), "encoder_in_channels"),
    (dict(decoder_in_channels=(32, 32, 16)), "decoder_in_channels"),
    (dict(model_type="rt_detr_v2", decoder_n_levels=2), "decoder_n_levels"),
    (dict(encode_proj_layers=(3,)), "encode_proj_layers"),
    (dict(decoder_attention_heads=3), "decoder_attention_heads"),
    (dict(decoder_method="nearest"), "decoder_method"),
    (dict(embedding_size=4), "downsample_in_first_stage"),
    (dict(layer_type="bottleneck", hidden_sizes=(2, 16, 24, 32)), "hidden_sizes"),
    (dict(hidden_expansion=0.01), "hidden_expansion"),
])
def test_bad_configs_are_refused_by_name(bad, field):
    with pytest.raises(ConfigError, match=field):
        fastzoo.create("rtdetr_r50vd", **{**TINY, **bad})


@pytest.mark.parametrize("version", ["rt_detr", "rt_detr_v2"])
def test_a_config_naming_a_backbone_to_load_is_refused_naming_it(version):
    """transformers' ``backbone="microsoft/resnet-18"`` without a ``backbone_config`` loads that backbone by
    name; fastzoo builds the ResNet-vd of ``backbone_config`` and refuses the name rather than build another."""
    from fastzoo.errors import CheckpointError
    from fastzoo.models.rt_detr.convert import HF

    named = {"model_type": version, "backbone": "microsoft/resnet-18", "backbone_config": None,
             "use_pretrained_backbone": True}
    with pytest.raises(CheckpointError, match="backbone='microsoft/resnet-18'"):
        HF.config_from_json(named)


def test_names_give_their_versions_and_sizes():
    from fastzoo.registry import get_entry

    assert fastzoo.create("PekingU/rtdetr_v2_r18vd", **TINY).config.model_type == "rt_detr_v2"
    assert get_entry("PekingU/rtdetr_v2_r18vd").config["model_type"] == "rt_detr_v2"
    assert get_entry("rtdetr_r18vd").config["decoder_layers"] == 3 and get_entry("rtdetr_r18vd").config["layer_type"] == "basic"
    assert get_entry("PekingU/rtdetr_r101vd_coco_o365").config["encoder_hidden_dim"] == 384


def test_a_deformable_kernel_this_machine_cannot_run_is_refused_by_name():
    from fastzoo.errors import BackendUnavailableError, UnknownBackendError

    ours = fastzoo.create("rtdetr_r50vd", **TINY)
    with pytest.raises(BackendUnavailableError, match="triton"):
        ours.set_deformable_attention("triton")
    with pytest.raises(UnknownBackendError, match="refrence"):
        ours.set_deformable_attention("refrence")
    assert {m.impl for m in ours.deformable_attentions()} == {"auto"}  # nothing changed


def test_unknown_forward_keywords_are_refused_by_name():
    ours = fastzoo.create("rtdetr_r50vd", **TINY)
    with pytest.raises(ValueError, match="output_attentions"):
        ours(pixel_values=batch()[0], output_attentions=True)


def test_images_whose_maps_do_not_halve_are_refused_naming_the_size():
    """transformers fails inside its FPN on a size mismatch; 80 px gives maps of 10, 5 and 3."""
    ours = fastzoo.create("rtdetr_r50vd", **TINY).eval()
    assert ours.image_side_multiple == 32
    with pytest.raises(ValueError, match=r"pixel_values: \(64, 80\) images .* \[10, 5, 3\].* multiples of 32"):
        ours(pixel_values=torch.randn(1, 3, 64, 80))
    assert ours(pixel_values=torch.randn(1, 3, 64, 96)).logits.isfinite().all()


def test_a_lone_image_too_small_for_train_mode_batchnorm_is_refused_naming_it():
    """One 32 px image leaves the coarsest map (stride 32) one position, which BatchNorm cannot normalise in
    train mode (torch raises a bare 'Expected more than 1 value per channel'); two images, or eval, run."""
    ours = fastzoo.create("rtdetr_r50vd", **TINY).train()
    assert ours.min_image_side == 64
    with pytest.raises(ValueError, match=r"pixel_values: one \(32, 32\) image .* at least 64 px"):
        ours(pixel_values=torch.randn(1, 3, 32, 32))
    assert ours(pixel_values=torch.randn(2, 3, 32, 32)).logits.isfinite().all()
    assert ours.eval()(pixel_values=torch.randn(1, 3, 32, 32)).logits.isfinite().all()


def test_backbone_maps_that_skip_a_stage_are_refused_at_config():
    with pytest.raises(ConfigError, match="consecutive") as e:
        fastzoo.create("rtdetr_r50vd", device="meta", **{**TINY, "backbone_out_indices": (1, 3, 4)})
    assert "backbone_out_indices" in e.value.fields


@pytest.mark.parametrize("bad", ["class id", "negative class id", "NaN box", "box past 1"])
def test_bad_label_values_are_refused_by_name_and_change_nothing(bad):
    """The label values come back with the set loss's one host read, after the forward: the denoising queries
    embed the class ids clamped (an id out of the embedding's range would be a bare IndexError first), and the
    running statistics train-mode BatchNorm moved are put back when the values are refused by name."""
    ours = fastzoo.create("rtdetr_r50vd", **TINY).train()
    x, labels = batch()
    if bad.endswith("class id"):
        labels[2]["class_labels"][1] = -1 if bad.startswith("negative") else ours.config.num_labels + 3
    else:
        labels[2]["boxes"][1, 0] = float("nan") if bad == "NaN box" else 1.5
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"labels\[2\]\['(class_labels|boxes)'\]\[1\]"):
        ours(pixel_values=x, labels=labels)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_training_step_reads_the_host_once(version):
    """One host read per training step (forward with the denoising queries, loss, backward), the set loss's: it
    carries every Hungarian-matched layer's cost and the label checks; the deformable seam is given the level sizes
    the model holds on the host, the denoising positives come from the box counts (counted as the benchmarks count,
    `fastzoo.bench.set_loss.HostReads`)."""
    from fastzoo.bench.set_loss import host_reads

    ours = fastzoo.create("rtdetr_r50vd", **TINY, **CASES[version]).train()
    x, labels = batch()
    assert host_reads(lambda: ours(pixel_values=x, labels=labels).loss.backward()) == 1


def fp64_rounding(run, hf, x, labels) -> dict:
    """The original's own fp32 rounding of the loss's gradients: against its fp64 run."""
    other = copy.deepcopy(hf).double()
    run(other, x.double(), labels_in(labels, torch.float64)).loss.backward()
    return {"exact": {n: g.float() for n, g in grads(other).items()}}


def compare_loss_path(hf, ours, x, labels, seed=0):
    """``detection_checks.compare_loss_path``: logits and boxes with the denoising queries (as transformers'),
    every gradient against the original's fp64 run."""
    return check_loss_path(hf, ours, x, labels, seed=seed, min_grads=80, own_rounding=fp64_rounding)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_with_denoising_equal_to_transformers(name):
    hf = original(**CASES[name])
    ours = fastzoo.create(pretrained=hf).train()
    out = compare_loss_path(hf, ours, *batch(seed=9))
    assert any(k.endswith("_dn_0") for k in out.loss_dict)  # the denoising terms ran
    assert out.logits.shape[1] > TINY["num_queries"]  # denoising queries first, as transformers'


@pytest.mark.parametrize("mode", GIOU_IMPLS)
def test_loss_equal_to_transformers_in_every_giou_mode(mode):
    hf = original(**CASES["v2"])
    ours = fastzoo.create(pretrained=hf, giou_impl=mode).train()
    compare_loss_path(hf, ours, *batch(seed=10))


def test_loss_without_boxes_without_auxiliary_terms_and_in_eval_mode_equal_transformers():
    hf = original(auxiliary_loss=False)
    ours = fastzoo.create(pretrained=hf).train()
    assert list(compare_loss_path(hf, ours, *batch(seed=11)).loss_dict) == ["loss_vfl", "loss_bbox", "loss_giou"]
    hf = original()
    ours = fastzoo.create(pretrained=hf).train()
    compare_loss_path(hf, ours, *batch(seed=12, counts=(0, 0, 0)))  # no box: no denoising queries
    hf.eval()
    ours.eval()
    out = compare_loss_path(hf, ours, *batch(seed=13))  # eval mode: no denoising queries, the loss still computed
    assert out.logits.shape[1] == TINY["num_queries"] and not any("_dn_" in k for k in out.loss_dict)


@cuda_only()
@pytest.mark.parametrize("name", ["v1", "v2"])
def test_on_cuda_with_the_triton_kernel_equal_to_transformers(name):
    """The decoder's deformable attention through the Triton kernel on CUDA, fp32 (TF32 off in both models):
    train mode with denoising, every output and gradient, and the loss path."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    hf = original(**CASES[name])
    ours = fastzoo.create(pretrained=hf).cuda().train()
    hf.cuda()
    ours.set_deformable_attention("triton")
    x, labels = batch(seed=14)
    x, labels = x.cuda(), [{k: v.cuda() for k, v in t.items()} for t in labels]
    compare_train(hf, ours, x, labels)
    compare_loss_path(hf, ours, x, labels)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """transformers' switch (its Trainer's ``gradient_checkpointing=True``, the config's legacy field): AIFI's
    and the decoder's layers recompute their activations in the backward; with the denoising queries, the loss and every gradient equal
    the run that kept them (the same ops from the same inputs: up to the backward's summation order, 1e-6 of
    the largest gradient, as DETR's tests/test_detr_checkpointing.py)."""
    hf = original(**CASES["v2"])
    plain = fastzoo.create(pretrained=hf).train()
    ckpt = fastzoo.create(pretrained=hf, gradient_checkpointing=True).train()
    assert ckpt.is_gradient_checkpointing
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert type(ckpt).supports_gradient_checkpointing and ckpt.is_gradient_checkpointing
    x, labels = batch()
    runs = []
    for m in (plain, ckpt):
        torch.manual_seed(0)  # the same denoising groups
        loss = m(pixel_values=x, labels=labels).loss
        loss.backward()
        runs.append((loss.detach(), grads(m)))
    (loss_ref, ref), (loss, got) = runs
    top = max(g.abs().max().item() for g in ref.values())
    assert torch.equal(loss, loss_ref) and set(got) == set(ref) and len(ref) > 80
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) <= 1e-6 * top
    ckpt.gradient_checkpointing_disable()
    assert not ckpt.is_gradient_checkpointing
    # PEFT's idiom: every weight frozen, the input projections' outputs marked as needing a gradient
    ckpt.requires_grad_(False)
    ckpt.enable_input_require_grads()
    assert ckpt(pixel_values=x).logits.requires_grad
    ckpt.disable_input_require_grads()
    assert not ckpt(pixel_values=x).logits.requires_grad


def test_transformers_model_api_answers_as_its_class():
    """What transformers' Trainer and tests read: the parameter count, the heads v2 holds under two names
    (``_tied_weights_keys``, each pattern naming parameters that share storage), no input embeddings, no generation."""
    from transformers.modeling_utils import _get_tied_weight_keys

    hf = original(**CASES["v2"])
    ours = fastzoo.create(pretrained=hf)
    shared = {n for names in _shared_names(ours) for n in names}
    tied = _get_tied_weight_keys(ours)
    assert tied and shared and all(any(re.search(k, n) for k in tied) for n in shared)
    assert all(any(re.search(k, n) for n in shared) for k in tied)
    assert not _get_tied_weight_keys(fastzoo.create(pretrained=original()))  # v1 holds its heads once
    assert ours.num_parameters() == hf.num_parameters() == sum(p.numel() for p in ours.parameters())
    ours.model.backbone.requires_grad_(False)
    assert ours.num_parameters(only_trainable=True) == sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert not ours.can_generate()
    with pytest.raises(NotImplementedError, match="pixel_values"):
        ours.get_input_embeddings()


def test_more_decoder_inputs_than_encoder_maps_project_the_coarsest_again_as_transformers():
    """``decoder_in_channels`` longer than the encoder's maps (transformers' tests build it): the extra 1x1
    projections read the coarsest map again; equal to transformers in eval and train mode, and a bare state
    dict gives that architecture back (the 1x1 projections are decoder_in_channels, the 3x3 ones the levels beyond)."""
    over = dict(decoder_in_channels=(32, 32, 32, 32), num_feature_levels=5)
    hf = original(**over)
    ours = fastzoo.create(pretrained=hf)
    compare_eval(hf, ours, batch()[0])
    x, labels = batch(seed=3)
    compare_train(hf, ours.train(), x, labels, seed=3)
    given = {k: TINY[k] for k in ("encoder_attention_heads", "decoder_attention_heads", "decoder_n_points",
                                  "num_queries", "num_denoising")}
    bare = fastzoo.create("rtdetr_r50vd", pretrained=hf.state_dict(), **given).config
    assert bare.decoder_in_channels == over["decoder_in_channels"] and bare.num_feature_levels == 5


def _shared_names(model) -> list[list[str]]:
    """The state-dict names that share one storage, per storage."""
    by_storage: dict = {}
    for name, t in model.state_dict().items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]
