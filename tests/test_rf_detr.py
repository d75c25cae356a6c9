"""RF-DETR against transformers' RfDetrForObjectDetection on the same weights, every parameter drawn
(`fastzoo.equivalence.weights.draw_`): in eval mode logits, boxes, the encoder's proposals and the decoder's
hidden states; in train mode (every Group-DETR group) every output and every parameter gradient, for every CPU
attention backend of the self-attentions and every deformable attention kernel serving the CPU; the loss (every
loss_dict term, in every GIoU mode, with and without auxiliary terms, boxes, eval mode) and its gradients;
windowed and unwindowed backbones, padded batches, images of other sides than the position grid's;
checkpoints both ways; bad configs and inputs refused by name.

The tolerance is fastzoo.equivalence's fp32 rule: outputs 1e-4 absolute (or 8 ulps of their scale), gradients 1e-4
of their scale (or 3x transformers' own fp32 rounding against its fp64 run where larger)."""
import copy

import pytest
import torch
from conftest import SPECS, backends
from detection_checks import boxes_labels, failures, grads, labels_in, read_back

import fastzoo
from fastzoo.attention.deformable import available
from fastzoo.equivalence.rule import compare_grads, compare_outputs
from fastzoo.equivalence.weights import draw_
from fastzoo.errors import CheckpointError, ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.models.rf_detr.convert import HF

TINY = dict(SPECS["rf_detr"].tiny)
CASES = {
    "windows": {},
    "one_window_relu_more_outputs": dict(num_windows=1, backbone_out_indices=(1, 3, 4, 6), activation_function="relu",
                                         c2f_num_blocks=2, decoder_layers=3, apply_layernorm=False),
}
IMPLS = available(torch.device("cpu"), torch.float32, backward=True)
OUTPUTS = ("logits", "pred_boxes", "enc_outputs_class", "enc_outputs_coord_logits", "intermediate_hidden_states")


def original(**overrides):
    """transformers' model, every parameter drawn, then its box deltas scaled as a trained model's (the spec's
    ``like_trained``: at full scale the boxes lie far outside the image, where the bilinear sampling amplifies fp32
    rounding a thousandfold)."""
    torch.manual_seed(0)
    hf = draw_(SPECS["rf_detr"].original.build({**TINY, **overrides})).train()
    SPECS["rf_detr"].original.like_trained(hf)
    return hf


def batch(seed=0, counts=(2, 0, 5), size=(32, 48)):
    """3 images (sides multiples of patch 4 x 2 windows), their boxes and class ids."""
    g = torch.Generator().manual_seed(seed)
    labels = boxes_labels(counts, TINY["num_labels"], g)
    return torch.randn(len(counts), 3, *size, generator=g), labels


def padded_mask(x):
    """The second image padded on the right, the third at the bottom."""
    mask = torch.ones(x.shape[0], *x.shape[-2:], dtype=torch.long)
    mask[1, :, -16:] = 0
    mask[2, -8:] = 0
    return mask


def run(model, x, mask=None, labels=None):
    return model(pixel_values=x, pixel_mask=mask, labels=labels)


def fp64(hf, x, mask=None, labels=None):
    other = copy.deepcopy(hf).double()
    return other, run(other, x.double(), mask, None if labels is None else labels_in(labels, torch.float64))


def compare_eval(hf, ours, x, mask=None):
    hf.eval()
    ours.eval()
    with torch.no_grad():
        o1, o2 = run(hf, x, mask), run(ours, x, mask)
        _, o64 = fp64(hf, x, mask)
    checks = [compare_outputs(k, getattr(o2, k), getattr(o1, k), exact=getattr(o64, k)) for k in OUTPUTS]
    assert not failures(checks), failures(checks)


def synthetic_loss(out, seed=0) -> torch.Tensor:
    """A scalar reaching every output through fixed random weights (every layer, query and group, the encoder's
    proposals), so each parameter's gradient is compared."""
    g = torch.Generator().manual_seed(seed)
    return sum((getattr(out, k) * torch.randn(getattr(out, k).shape, generator=g)).sum() for k in OUTPUTS)


def compare_train(hf, ours, x, mask=None, labels=None):
    """Train mode: every output (all groups) within the rule, and every gradient of a synthetic loss on them
    (``labels``: of the loss instead, and every loss_dict term), against transformers' fp64 run where larger."""
    hf.train()
    ours.train()
    hf.zero_grad()
    ours.zero_grad()
    o1, o2 = run(hf, x, mask, labels), run(ours, x, mask, labels)
    other, o64 = fp64(hf, x, mask, labels)
    assert o2.logits.shape == o1.logits.shape == (x.shape[0], TINY["num_queries"] * hf.config.group_detr, TINY["num_labels"])
    checks = [compare_outputs(k, getattr(o2, k), getattr(o1, k), exact=getattr(o64, k)) for k in OUTPUTS]
    if labels is None:
        losses = [synthetic_loss(o) for o in (o1, o2, o64)]
    else:
        assert list(o2.loss_dict) == list(o1.loss_dict)
        checks += [compare_outputs(k, o2.loss_dict[k], o1.loss_dict[k], exact=o64.loss_dict[k].float())
                   for k in o1.loss_dict]
        checks.append(compare_outputs("loss", o2.loss, o1.loss, exact=o64.loss.float()))
        for i, (a, b, c) in enumerate(zip(o1.auxiliary_outputs or [], o2.auxiliary_outputs or [], o64.auxiliary_outputs or [],
                                          strict=True)):
            checks += [compare_outputs(f"aux {i} {k}", b[k], a[k], exact=c[k]) for k in ("logits", "pred_boxes")]
        losses = [o1.loss, o2.loss, o64.loss]
    for loss in losses:
        loss.backward()
    g1, g2 = HF.to_fastzoo(grads(hf)), grads(ours)
    exact = {k: v.float() for k, v in HF.to_fastzoo(grads(other)).items()}
    assert len(g1) > 100 and set(g1) == set(g2), set(g1) ^ set(g2)
    checks.append(compare_grads("grads", g2, g1, exact=exact))
    assert not failures(checks), failures(checks)
    return o2


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, original(**CASES[request.param])


def test_eval_mode_equal_to_transformers(case):
    _, hf = case
    ours = fastzoo.create(pretrained=hf)
    assert not ours.training  # as transformers' from_pretrained gives it
    x = batch()[0]
    compare_eval(hf, ours, x)
    compare_eval(hf, ours, x, padded_mask(x))


def test_images_of_other_sides_than_the_position_grid_equal_transformers():
    """The position embedding resampled (bicubic, antialiased) for a non-square and for a larger square image."""
    hf = original()
    ours = fastzoo.create(pretrained=hf)
    compare_eval(hf, ours, batch(seed=1, size=(48, 24))[0])
    compare_eval(hf, ours, batch(seed=2, size=(40, 40), counts=(1,))[0])


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_train_mode_equal_to_transformers_for_every_backend(case, attn):
    _, hf = case
    backend, options = attn
    ours = fastzoo.create(pretrained=hf).set_attention(backend, **options)
    x = batch(seed=3)[0]
    compare_train(hf, ours, x, padded_mask(x))


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_to_transformers_for_every_deformable_kernel(impl):
    hf = original()
    ours = fastzoo.create(pretrained=hf).set_deformable_attention(impl)
    x, labels = batch(seed=4)
    compare_train(hf, ours, x, labels=labels)
    compare_eval(hf, ours, x)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_its_gradients_equal_to_transformers(name):
    hf = original(**CASES[name])
    ours = fastzoo.create(pretrained=hf)
    x, labels = batch(seed=5)
    out = compare_train(hf, ours, x, padded_mask(x), labels)
    L = hf.config.decoder_layers
    assert len(out.loss_dict) == 4 * (L + 1) and "loss_ce_enc" in out.loss_dict and f"loss_giou_{L - 2}" in out.loss_dict


@pytest.mark.parametrize("mode", GIOU_IMPLS)
def test_loss_equal_to_transformers_in_every_giou_mode(mode):
    hf = original()
    ours = fastzoo.create(pretrained=hf, giou_impl=mode)
    x, labels = batch(seed=6)
    compare_train(hf, ours, x, labels=labels)


def test_loss_with_more_boxes_than_queries_without_boxes_without_auxiliary_terms_and_in_eval_mode():
    """More boxes than a group's queries (as many matched as there are queries), a batch without a box, no
    auxiliary terms; in eval mode transformers' loss still matches the first queries in group_detr groups."""
    hf = original()
    ours = fastzoo.create(pretrained=hf)
    x, labels = batch(seed=7, counts=(TINY["num_queries"] + 2, 1, 0))
    compare_train(hf, ours, x, labels=labels)
    x, labels = batch(seed=8, counts=(0, 0, 0))
    compare_train(hf, ours, x, labels=labels)
    hf = original(auxiliary_loss=False)
    ours = fastzoo.create(pretrained=hf)
    x, labels = batch(seed=9)
    out = compare_train(hf, ours, x, labels=labels)
    assert list(out.loss_dict) == [f"{k}{s}" for s in ("", "_enc")
                                   for k in ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error")]
    hf.eval()
    ours.eval()
    x, labels = batch(seed=10)
    with torch.no_grad():
        o1, o2 = run(hf, x, labels=labels), run(ours, x, labels=labels)
        _, o64 = fp64(hf, x, labels=labels)
    assert o2.logits.shape[1] == TINY["num_queries"]
    failed = [(k, c.err, c.bound) for k in o1.loss_dict
              for c in [compare_outputs(k, o2.loss_dict[k], o1.loss_dict[k], exact=o64.loss_dict[k].float())] if not c.passed]
    assert not failed, failed


def test_save_pretrained_round_trips_with_transformers(tmp_path):
    """Written by fastzoo, read by transformers (and back by fastzoo), in eval mode as transformers loads."""
    import transformers

    hf = original(**CASES["one_window_relu_more_outputs"])
    ours = fastzoo.create(pretrained=hf)
    # the fp32 rule: transformers loads with SDPA
    back, again = read_back(hf, ours, tmp_path, transformers.RfDetrForObjectDetection, pixel_values=batch(seed=11)[0])
    assert again.config == ours.config
    assert set(back.state_dict()) == set(hf.state_dict())
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in back.state_dict().items())


def test_transformers_state_dict_loads_all_or_nothing():
    """A bare state dict gives the sizes its tensors show (heads and output blocks as given); a missing key or a
    tensor of another shape is refused, naming it."""
    hf = original()
    state = hf.state_dict()
    given = {k: TINY[k] for k in ("num_attention_heads", "backbone_out_indices", "num_windows",
                                  "decoder_self_attention_heads", "decoder_cross_attention_heads", "dropout")}
    ours = fastzoo.create("Roboflow/rf-detr-base", pretrained=state, **given)
    made = fastzoo.create("rf_detr_base", **TINY).config
    for field in ("hidden_size", "num_hidden_layers", "image_size", "patch_size", "d_model", "num_queries", "group_detr",
                  "decoder_layers", "decoder_n_points", "c2f_num_blocks", "hidden_expansion", "num_labels"):
        assert getattr(ours.config, field) == getattr(made, field), field
    compare_eval(hf, ours, batch(seed=12)[0])
    missing = {k: v for k, v in state.items() if k != "model.decoder.layers.1.cross_attn.value_proj.bias"}
    with pytest.raises(CheckpointError, match="value_proj.bias"):
        fastzoo.create("rf_detr_base", pretrained=missing, **{**TINY})
    wrong = {**state, "class_embed.bias": torch.zeros(TINY["num_labels"] + 1)}
    with pytest.raises(CheckpointError, match="class_embed"):
        fastzoo.create("rf_detr_base", pretrained=wrong, **{**TINY})


@pytest.mark.parametrize("bad, field", [
    (dict(backbone_out_indices=(4, 2)), "backbone_out_indices"),
    (dict(backbone_out_indices=(2, 7)), "backbone_out_indices"),
    (dict(decoder_cross_attention_heads=3), "decoder_cross_attention_heads"),
    (dict(num_feature_levels=2), "num_feature_levels"),
    (dict(attention_bias=False), "attention_bias"),
    (dict(hidden_expansion=0.01), "hidden_expansion"),
    (dict(image_size=30), "image_size"),
    (dict(d_model=34, decoder_self_attention_heads=1, decoder_cross_attention_heads=1), "d_model"),
])
def test_bad_configs_are_refused_by_name(bad, field):
    with pytest.raises(ConfigError, match=field):
        fastzoo.create("rf_detr_base", **{**TINY, **bad})


def test_bad_inputs_are_refused_by_name():
    ours = fastzoo.create("rf_detr_base", **TINY).eval()
    assert ours.image_side_multiple == 8
    with pytest.raises(ValueError, match=r"pixel_values: \(32, 44\) images .* multiples of 8"):
        ours(pixel_values=torch.randn(1, 3, 32, 44))
    with pytest.raises(ValueError, match="num_queries=6"):
        ours(pixel_values=torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="output_attentions"):
        ours(pixel_values=batch()[0], output_attentions=True)
    with pytest.raises(ValueError, match=r"labels\[1\]"):
        ours(pixel_values=batch()[0], labels=[batch()[1][0], {"boxes": torch.zeros(1, 4)}, batch()[1][2]])


def test_names_give_their_sizes():
    from fastzoo.registry import get_entry

    assert get_entry("Roboflow/rf-detr-base").config["decoder_n_points"] == 2
    nano = get_entry("Roboflow/rf-detr-nano").config
    assert (nano["patch_size"], nano["num_windows"], nano["decoder_layers"], nano["image_size"]) == (16, 2, 2, 384)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """transformers' switch (its Trainer's ``gradient_checkpointing=True``): the DINOv2's blocks and the decoder's
    layers recompute their activations in the backward, and the loss and every gradient equal the run that kept
    them (the same ops from the same inputs: up to the backward's summation order, 1e-6 of the largest gradient, as
    DETR's tests/test_detr_checkpointing.py); what the Trainer also reads: ``num_parameters``, input grads for PEFT."""
    hf = original()
    plain = fastzoo.create(pretrained=hf).train()
    assert type(plain).supports_gradient_checkpointing and not plain.is_gradient_checkpointing
    ckpt = fastzoo.create(pretrained=hf, gradient_checkpointing=True).train()  # the config's legacy field
    assert ckpt.is_gradient_checkpointing
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert ckpt.is_gradient_checkpointing
    calls = []
    for layer in [*ckpt.model.backbone.backbone.blocks, *ckpt.model.decoder.layers]:
        layer.register_forward_pre_hook(lambda m, a: calls.append(m))
    x, labels = batch(seed=9)
    runs = []
    for m in (plain, ckpt):
        loss = run(m, x, padded_mask(x), labels).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss_ref, ref), (loss, got) = runs
    assert len(calls) == 2 * (TINY["num_hidden_layers"] + TINY["decoder_layers"])  # each ran again in the backward
    top = max(g.abs().max().item() for g in ref.values())
    assert torch.equal(loss, loss_ref) and set(got) == set(ref) and any("backbone.backbone.blocks" in n for n in ref)
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) <= 1e-6 * top
    ckpt.gradient_checkpointing_disable()
    assert not ckpt.is_gradient_checkpointing
    assert ckpt.num_parameters() == hf.num_parameters() == sum(p.numel() for p in ckpt.parameters())
    ckpt.requires_grad_(False)  # PEFT's idiom: every weight frozen, the patch embedding's output needing a gradient
    ckpt.enable_input_require_grads()
    assert run(ckpt, x).logits.requires_grad
    ckpt.disable_input_require_grads()
    assert not run(ckpt, x).logits.requires_grad
