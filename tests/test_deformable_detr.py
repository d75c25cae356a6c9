"""Deformable DETR against transformers' DeformableDetrForObjectDetection on the same weights, every
parameter and buffer drawn (`fastzoo.equivalence.weights.draw_`): logits, boxes, every loss term (the
focal term, auxiliary layers) and every parameter gradient, on padded images of different sizes with 0
to more-than-queries boxes, plain, with box refinement, two-stage, untied heads and single-scale; for
every CPU attention backend of the decoder's self-attention, every deformable attention kernel serving
the CPU and every GIoU mode; checkpoints both ways; config errors by name."""
import copy
import re

import pytest
import torch
from conftest import SPECS, backends
from detection_checks import backward, boxes_labels, failures, grads, labels_in, read_back

import fastzoo
from fastzoo.attention.deformable import available
from fastzoo.equivalence.rule import FP32_GRAD_RTOL, compare_grads, compare_outputs
from fastzoo.equivalence.weights import draw_
from fastzoo.errors import ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS

TINY = dict(SPECS["deformable_detr"].tiny)
CASES = {
    "plain": {},
    "box_refine": dict(with_box_refine=True, auxiliary_loss=True),
    "two_stage": dict(with_box_refine=True, two_stage=True, auxiliary_loss=True),
    "untied_heads": dict(tie_word_embeddings=False, auxiliary_loss=True),
    "single_scale": dict(num_feature_levels=1, backbone_out_indices=(4,)),
}
IMPLS = available(torch.device("cpu"), torch.float32, backward=True)


def original(**overrides):
    torch.manual_seed(0)
    return draw_(SPECS["deformable_detr"].original.build({**TINY, "dropout": 0.0, **overrides})).train()


def batch(seed=0, counts=(2, 0, 5)):
    """3 images of different sizes padded to 64 x 80 (pixel_mask)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 3, 64, 80, generator=g)
    mask = torch.ones(3, 64, 80, dtype=torch.long)
    mask[1, :, 48:] = 0
    mask[2, 40:, :] = 0
    return x, mask, boxes_labels(counts, TINY["num_labels"], torch.Generator().manual_seed(seed))


CANCELLED = re.compile(r"model\.input_proj\.\d+\.0\.bias")  # a conv's bias right before a GroupNorm


def own_grads(hf, x, mask, labels, dtype=torch.float32, attn="eager") -> dict:
    """The original's gradients in ``dtype`` on transformers' ``attn`` kernel: its own rounding, which the
    rule lets widen the bound of an ill-conditioned gradient."""
    other = copy.deepcopy(hf).to(dtype)
    other.config._attn_implementation = attn
    other(pixel_values=x.to(dtype), pixel_mask=mask, labels=labels_in(labels, dtype)).loss.backward()
    return {n: g.float() for n, g in grads(other).items()}


def compare(hf, ours, x, mask, labels):
    """fastzoo.equivalence's fp32 rule: outputs and loss terms 1e-4 absolute, gradients 1e-4 of their scale
    (or 3x the original's own fp32 rounding, on transformers' SDPA and against its fp64 run, where larger)."""
    o1 = hf(pixel_values=x, pixel_mask=mask, labels=labels)
    o2 = ours(pixel_values=x, pixel_mask=mask, labels=labels)
    checks = [compare_outputs("logits", o2.logits, o1.logits), compare_outputs("pred_boxes", o2.pred_boxes, o1.pred_boxes),
              compare_outputs("loss", o2.loss, o1.loss)]
    assert list(o2.loss_dict) == list(o1.loss_dict)
    checks += [compare_outputs(k, o2.loss_dict[k], o1.loss_dict[k]) for k in o1.loss_dict]
    for a, b in zip(o1.auxiliary_outputs or [], o2.auxiliary_outputs or [], strict=True):
        checks += [compare_outputs("aux logits", b["logits"], a["logits"]), compare_outputs("aux boxes", b["pred_boxes"], a["pred_boxes"])]
    if o1.enc_outputs_class is not None:
        checks.append(compare_outputs("enc_outputs_class", o2.enc_outputs_class, o1.enc_outputs_class))
    g1, g2 = backward(hf, ours, o1.loss, o2.loss)
    assert len(g1) > 50 and set(g1) == set(g2)
    # a convolution's bias under GroupNorm: the group's mean takes it away, its true gradient is 0 (the fp64
    # run's is ~1e-17) and both fp32 gradients are rounding noise: each within FP32_GRAD_RTOL of the largest
    top = max(g.abs().max().item() for g in g1.values())
    cancelled = [n for n in g1 if CANCELLED.fullmatch(n)]
    for n in cancelled:
        assert max(g1.pop(n).abs().max().item(), g2.pop(n).abs().max().item()) <= FP32_GRAD_RTOL * top, n
    kernels, exact = (own_grads(hf, x, mask, labels, *how) for how in ((torch.float32, "sdpa"), (torch.float64,)))
    for own in (kernels, exact):
        for n in cancelled:
            own.pop(n)
    checks.append(compare_grads("grads", g2, g1, kernels=kernels, exact=exact))
    assert not failures(checks), failures(checks)
    return o2


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, original(**CASES[request.param])


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_equal_to_transformers_for_every_backend(case, attn):
    name, hf = case
    backend, options = attn
    ours = fastzoo.create("deformable_detr", pretrained=hf).set_attention(backend, **options).train()
    compare(hf, ours, *batch())


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_to_transformers_for_every_deformable_kernel(impl):
    hf = original(**CASES["two_stage"])
    ours = fastzoo.create("deformable_detr", pretrained=hf).set_deformable_attention(impl).train()
    compare(hf, ours, *batch(seed=2))


@pytest.mark.parametrize("mode", GIOU_IMPLS)
def test_equal_to_transformers_in_every_giou_mode(mode):
    hf = original(**CASES["box_refine"])
    ours = fastzoo.create("deformable_detr", pretrained=hf, giou_impl=mode).train()
    compare(hf, ours, *batch(seed=1))


def test_more_boxes_than_queries_and_all_images_empty_equal_transformers():
    hf = original(**CASES["untied_heads"])
    ours = fastzoo.create("deformable_detr", pretrained=hf).train()
    compare(hf, ours, *batch(seed=3, counts=(TINY["num_queries"] + 3, 1, 0)))
    compare(hf, ours, *batch(seed=4, counts=(0, 0, 0)))


@pytest.mark.parametrize("counts", [(0, 0, 0), (0, 3, 0)], ids=["no_boxes", "an_image_without_boxes"])
def test_two_stage_gradients_without_boxes_are_transformers(counts):
    """Two-stage with box refinement, images without boxes: the same parameters have a gradient as in
    transformers, with its values. The proposal heads (``class_embed.{L}``, ``bbox_embed.{L}``) and
    ``enc_output`` have none in either (no loss term reads the proposals: their boxes are detached, their
    scores only rank); without any box the box heads' gradients are zeros on both sides, not None."""
    hf = original(**CASES["two_stage"])
    ours = fastzoo.create("deformable_detr", pretrained=hf).train()
    compare(hf, ours, *batch(seed=5, counts=counts))
    L = TINY["decoder_layers"]
    proposals = (f"model.decoder.class_embed.{L}.weight", f"model.decoder.bbox_embed.{L}.layers.0.weight",
                 "model.enc_output.weight")
    for model in (hf, ours):
        params = dict(model.named_parameters())
        assert all(params[n].requires_grad and params[n].grad is None for n in proposals)
        box = params["model.decoder.bbox_embed.0.layers.0.weight"].grad
        assert box is not None and (not counts[1]) == (not box.any())


def test_timm_backbone_path_equal_to_transformers():
    """The hub checkpoints' backbone: timm's ResNet-18 under transformers' timm path (C3..C5)."""
    hf = original(use_timm_backbone=True, backbone="resnet18", embedding_size=None, hidden_sizes=None, depths=None,
                  with_box_refine=True)
    ours = fastzoo.create("deformable_detr", pretrained=hf).train()
    x, mask, labels = batch(seed=5)
    compare(hf, ours, x[:2], torch.ones_like(mask[:2]), labels[:2])


@pytest.mark.parametrize("name", list(CASES))
def test_save_pretrained_round_trips_with_transformers(tmp_path, name):
    """Written by fastzoo, read by transformers (and back by fastzoo), in eval mode as transformers loads."""
    import transformers

    hf = original(**CASES[name])
    ours = fastzoo.create("deformable_detr", pretrained=hf)
    assert not ours.training
    x, mask, _ = batch(seed=6)
    read_back(hf, ours, tmp_path, transformers.DeformableDetrForObjectDetection, pixel_values=x, pixel_mask=mask)


@pytest.mark.parametrize("name", ["two_stage", "untied_heads", "single_scale"])
def test_a_bare_state_dict_gives_its_architecture(name):
    """From the keys alone: levels, stages read, two-stage, refinement and the heads' tying (heads and points
    are one product in the tensors: given, as a user gives a tiny model's heads; a two-stage model's proposal
    count is in no tensor)."""
    hf = original(**CASES[name])
    two_stage = CASES[name].get("two_stage", False)
    given = dict(num_queries=8, two_stage_num_proposals=8) if two_stage else {}
    ours = fastzoo.create("deformable_detr", pretrained=hf.state_dict(), encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_n_points=2, decoder_n_points=2, **given)
    for field in ("num_feature_levels", "backbone_out_indices", "two_stage", "with_box_refine",
                  "tie_word_embeddings", "d_model", *(() if two_stage else ("num_queries",))):
        assert getattr(ours.config, field) == getattr(fastzoo.create("deformable_detr", **TINY, **CASES[name]).config, field), field
    x, mask, _ = batch(seed=7)
    with torch.no_grad():
        assert (ours.eval()(pixel_values=x, pixel_mask=mask).logits
                - hf.eval()(pixel_values=x, pixel_mask=mask).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("bad, field", [
    (dict(two_stage=True), "with_box_refine"),
    (dict(two_stage=True, with_box_refine=True, two_stage_num_proposals=5), "two_stage_num_proposals"),
    (dict(backbone_out_indices=(1, 2, 3, 4, 4)), "backbone_out_indices"),
    (dict(num_feature_levels=2), "backbone_out_indices"),
    (dict(d_model=48, encoder_attention_heads=2, decoder_attention_heads=2), "d_model"),
])
def test_bad_configs_are_refused_by_name(bad, field):
    with pytest.raises(ConfigError, match=field):
        fastzoo.create("deformable_detr", **{**TINY, **bad})


def test_a_deformable_kernel_this_machine_cannot_run_is_refused_by_name():
    from fastzoo.errors import BackendUnavailableError, UnknownBackendError

    ours = fastzoo.create("deformable_detr", **TINY)
    with pytest.raises(BackendUnavailableError, match="triton"):
        ours.set_deformable_attention("triton")  # CUDA only (CPU: Triton's interpreter, under TRITON_INTERPRET=1)
    with pytest.raises(UnknownBackendError, match="refrence"):
        ours.set_deformable_attention("refrence")
    assert {m.impl for m in ours.modules() if hasattr(m, "sampling_offsets")} == {"auto"}  # nothing changed


def test_unknown_forward_keywords_are_refused_by_name():
    ours = fastzoo.create("deformable_detr", **TINY)
    x, mask, _ = batch()
    with pytest.raises(ValueError, match="output_attentions"):
        ours(pixel_values=x, pixel_mask=mask, output_attentions=True)


def test_a_level_of_one_position_is_refused_naming_the_images():
    """GroupNorm(32) of d_model 32 cannot normalise one position (transformers fails with torch's error, which
    names nothing); one more row and column of pixels is enough."""
    ours = fastzoo.create("deformable_detr", **TINY).train()
    assert ours.min_image_side == 128  # the fourth level's stride is 64
    with pytest.raises(ValueError, match=r"pixel_values: \(64, 64\) images leave feature level 3 .* at least 128 px"):
        ours(pixel_values=torch.randn(1, 3, 64, 64))  # C5 2 x 2, the strided fourth level 1 x 1
    assert ours(pixel_values=torch.randn(1, 3, 96, 64)).logits.isfinite().all()  # C5 3 x 2: the fourth 2 x 1
    assert ours(pixel_values=torch.randn(2, 3, 64, 64)).logits.isfinite().all()  # two images: torch's test passes


@pytest.mark.parametrize("extra", [{}, CASES["two_stage"]], ids=["plain", "two_stage"])
def test_a_training_step_reads_the_host_once(extra):
    """One host read per training step, the set loss's (its costs and the target checks together): the
    deformable seam is given the level sizes the model already holds on the host, so its input check and
    kernels read nothing back (counted as the benchmarks count, `fastzoo.bench.set_loss.HostReads`)."""
    from fastzoo.bench.set_loss import host_reads

    ours = fastzoo.create("deformable_detr", pretrained=original(**extra)).train()
    x, mask, labels = batch()
    assert host_reads(lambda: ours(pixel_values=x, pixel_mask=mask, labels=labels).loss.backward()) == 1


def test_gradient_checkpointing_gives_the_same_gradients():
    """transformers' switch (its Trainer's ``gradient_checkpointing=True``, the config's legacy field): every
    encoder and decoder layer recomputes its activations in the backward; the loss and every gradient equal
    the run that kept them (the same ops from the same inputs: up to the backward's summation order, 1e-6 of
    the largest gradient, as DETR's tests/test_detr_checkpointing.py)."""
    hf = original(**CASES["box_refine"])
    plain = fastzoo.create("deformable_detr", pretrained=hf).train()
    ckpt = fastzoo.create("deformable_detr", pretrained=hf, gradient_checkpointing=True).train()
    assert type(ckpt).supports_gradient_checkpointing and ckpt.is_gradient_checkpointing
    x, mask, labels = batch()
    runs = []
    for m in (plain, ckpt):
        loss = m(pixel_values=x, pixel_mask=mask, labels=labels).loss
        loss.backward()
        runs.append((loss.detach(), grads(m)))
    (loss_ref, ref), (loss, got) = runs
    top = max(g.abs().max().item() for g in ref.values())
    assert torch.equal(loss, loss_ref) and set(got) == set(ref)
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) <= 1e-6 * top
    ckpt.gradient_checkpointing_disable()
    assert not ckpt.is_gradient_checkpointing
    # PEFT's idiom: every weight frozen, the input projections' outputs marked as needing a gradient
    ckpt.requires_grad_(False)
    ckpt.enable_input_require_grads()
    assert ckpt(pixel_values=x, pixel_mask=mask).logits.requires_grad
    ckpt.disable_input_require_grads()
    assert not ckpt(pixel_values=x, pixel_mask=mask).logits.requires_grad


def test_transformers_model_api_answers_as_its_class():
    """What transformers' Trainer and tests read: the parameter count, the heads one module serves
    (``_tied_weights_keys``, each pattern naming parameters that share storage), the config's init_std."""
    from transformers.modeling_utils import _get_tied_weight_keys

    hf = original(**CASES["box_refine"])
    ours = fastzoo.create("deformable_detr", pretrained=hf)
    assert ours.num_parameters() == hf.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert sorted(_get_tied_weight_keys(ours)) == sorted(_get_tied_weight_keys(hf))
    fresh = fastzoo.create("deformable_detr", **TINY, init_std=1e-10)
    assert fresh.model.input_proj[0][0].weight.abs().max() < 1e-8  # transformers' normal(0, init_std)
