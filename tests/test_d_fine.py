"""D-FINE against transformers' DFineForObjectDetection on the same weights, every parameter and buffer drawn
(`fastzoo.equivalence.weights.draw_`), at a tiny config (HGNetV2 with learnable affine blocks and light stages,
per-level sampling points, 8 bins), 2 images of 64 x 64: eval-mode outputs (the last layer's logits, boxes and
edge distributions, the encoder's maps and query selection); in train mode with labels, the denoising queries
drawn from the same seed, every per-layer output (logits with the initial prediction, boxes, distributions,
initial boxes) and every parameter gradient, for every CPU attention backend and deformable attention kernel;
the loss (every loss_dict term, FGL and DDF of the auxiliary and denoising layers included) and its gradients;
checkpoints both ways; config errors by name."""
import copy

import pytest
import torch
from conftest import SPECS, backends
from detection_checks import backward, boxes_labels, failures, grads, labels_in, read_back
from detection_checks import compare_eval as check_eval
from detection_checks import compare_loss_path as check_loss_path

import fastzoo
from fastzoo.attention.deformable import available
from fastzoo.equivalence.rule import compare_grads, compare_outputs
from fastzoo.equivalence.weights import draw_
from fastzoo.errors import CheckpointError, ConfigError

TINY = dict(SPECS["d_fine"].tiny)
IMPLS = available(torch.device("cpu"), torch.float32, backward=True)


def original(**overrides):
    torch.manual_seed(0)
    return draw_(SPECS["d_fine"].original.build({**TINY, **overrides})).train()


def batch(seed=0, counts=(2, 3)):
    """2 images of 64 x 64 (a multiple of the coarsest stride, 32) and their boxes."""
    g = torch.Generator().manual_seed(seed)
    labels = boxes_labels(counts, TINY["num_labels"], g)
    return torch.randn(len(counts), 3, 64, 64, generator=g), labels


def compare_eval(hf, ours, x):
    """Every output, the distributions' too."""
    check_eval(hf, ours, x, ("logits", "pred_boxes", "intermediate_logits", "intermediate_predicted_corners",
                             "initial_reference_points", "intermediate_hidden_states", "enc_topk_logits",
                             "enc_topk_bboxes", "enc_outputs_class", "enc_outputs_coord_logits"))


def run_inner(model, x, labels, seed):
    """The inner model in train mode on ``labels`` (denoising queries after ``seed``): per-layer outputs, the
    denoising meta and the RNG's next draw."""
    torch.manual_seed(seed)
    if isinstance(model, fastzoo.models.d_fine.DFineForObjectDetection):
        o = model.model(x, labels)
        meta = o["dn"].meta if o["dn"] is not None else None
        out = {k: o[k] for k in ("logits", "boxes", "corners", "refs", "enc_topk_logits", "enc_topk_bboxes")}
    else:
        o = model.model(pixel_values=x, labels=labels)
        meta = o.denoising_meta_values
        out = dict(logits=o.intermediate_logits, boxes=o.intermediate_reference_points,
                   corners=o.intermediate_predicted_corners, refs=o.initial_reference_points,
                   enc_topk_logits=o.enc_topk_logits, enc_topk_bboxes=o.enc_topk_bboxes)
    return out, meta, torch.rand(4)


def synthetic_loss(out: dict, seed=0) -> torch.Tensor:
    """A scalar reaching every output through fixed random weights, so each parameter's gradient is compared."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for _, t in sorted(out.items()))


def compare_train(hf, ours, x, labels, seed=0):
    """Outputs by the fp32 rule (1e-4 absolute or 8 ulps of the scale, or 3x the original's own fp32 rounding
    against its fp64 run where larger: the edge distributions add up over the layers); gradients 1e-4 of their
    scale (or 3x that rounding); the denoising groups and the RNG's next draw exactly equal."""
    o1, m1, next1 = run_inner(hf, x, labels, seed)
    o2, m2, next2 = run_inner(ours, x, labels, seed)
    assert torch.equal(next1, next2)
    assert m1["dn_num_group"] == m2["dn_num_group"] and m1["dn_num_split"] == m2["dn_num_split"]
    other = copy.deepcopy(hf).double()
    o64, _, _ = run_inner(other, x.double(), labels_in(labels, torch.float64), seed)
    checks = [compare_outputs(k, o2[k], o1[k], exact=o64[k].detach().float()) for k in o1]
    g1, g2 = backward(hf, ours, synthetic_loss(o1), synthetic_loss(o2))
    synthetic_loss(o64).backward()
    assert len(g1) > 300 and set(g1) == set(g2)
    checks.append(compare_grads("grads", g2, g1, exact={n: g.float() for n, g in grads(other).items()}))
    assert not failures(checks), failures(checks)


@pytest.fixture(scope="module")
def hf():
    return original()


def test_eval_mode_equal_to_transformers(hf):
    ours = fastzoo.create(pretrained=hf)
    assert not ours.training and ours.config.model_type == "d_fine"
    compare_eval(hf, ours, batch()[0])


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_train_mode_with_denoising_equal_to_transformers_for_every_backend(hf, attn):
    name, options = attn
    ours = fastzoo.create(pretrained=hf).set_attention(name, **options).train()
    compare_train(hf, ours, *batch(seed=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_to_transformers_for_every_deformable_kernel(hf, impl):
    ours = fastzoo.create(pretrained=hf).set_deformable_attention(impl).train()
    compare_train(hf, ours, *batch(seed=2))


def sdpa_rounding(run, hf, x, labels) -> dict:
    """The original's own fp32 rounding of the loss's gradients: its run on its users' SDPA kernel against its eager
    run (transformers' D-FINE loss fails in fp64: its bin weights are made fp32)."""
    other = copy.deepcopy(hf)
    other.config._attn_implementation = "sdpa"  # its users' kernel (HGNetV2 refuses set_attn_implementation)
    run(other, x, labels).loss.backward()
    return {"kernels": grads(other)}


def compare_loss_path(hf, ours, x, labels, seed=0):
    """``detection_checks.compare_loss_path``: every gradient against the original's SDPA run."""
    return check_loss_path(hf, ours, x, labels, seed=seed, min_grads=300, own_rounding=sdpa_rounding)


def test_loss_with_denoising_equal_to_transformers(hf):
    """Every term: the last layer's, each auxiliary layer's with FGL and DDF, the encoder's, each denoising layer's
    with FGL and DDF (the last denoising layer distilled from itself: 0)."""
    ours = fastzoo.create(pretrained=hf).train()
    out = compare_loss_path(hf, ours, *batch(seed=3))
    L = TINY["decoder_layers"]
    assert {f"loss_fgl_aux_{L - 2}", f"loss_ddf_dn_{L - 1}", f"loss_vfl_aux_{L - 1}"} <= set(out.loss_dict)
    assert f"loss_fgl_aux_{L - 1}" not in out.loss_dict  # the encoder's proposals have no distributions
    assert out.loss_dict[f"loss_ddf_dn_{L - 1}"] == 0 and out.loss_dict["loss_ddf_aux_0"] > 0


def test_loss_without_boxes_without_auxiliary_terms_and_in_eval_mode_equal_transformers(hf):
    ours = fastzoo.create(pretrained=hf).train()
    compare_loss_path(hf, ours, *batch(seed=4, counts=(0, 0)))  # no box: no denoising queries
    hf.eval()
    ours.eval()
    out = compare_loss_path(hf, ours, *batch(seed=5))  # eval mode: the last layer and the encoder's proposals
    assert list(out.loss_dict) == ["loss_vfl", "loss_bbox", "loss_giou", "loss_vfl_aux_0", "loss_bbox_aux_0",
                                   "loss_giou_aux_0"]
    hf.train()
    plain = original(auxiliary_loss=False)
    ours = fastzoo.create(pretrained=plain).train()
    assert list(compare_loss_path(plain, ours, *batch(seed=6)).loss_dict) == ["loss_vfl", "loss_bbox", "loss_giou"]


def test_a_training_step_reads_the_host_once(hf):
    """One host read per training step (forward with the denoising queries, the loss with FGL and DDF, backward),
    the set loss's: it carries every Hungarian-matched layer's cost and the label checks; the deformable seam is
    given the level sizes the model holds on the host, the denoising positives come from the box counts (counted as
    the benchmarks count, `fastzoo.bench.set_loss.HostReads`)."""
    from fastzoo.bench.set_loss import host_reads

    ours = fastzoo.create(pretrained=hf).train()
    x, labels = batch()
    assert host_reads(lambda: ours(pixel_values=x, labels=labels).loss.backward()) == 1


def test_save_pretrained_round_trips_with_transformers(tmp_path, hf):
    """Written by fastzoo, read by transformers (and back by fastzoo), in eval mode as transformers loads."""
    import transformers

    read_back(hf, fastzoo.create(pretrained=hf), tmp_path, transformers.DFineForObjectDetection,
              pixel_values=batch(seed=7)[0])
    hf.train()


def test_a_bare_state_dict_gives_its_architecture(hf):
    """From the keys alone (heads the tensors show as a product, the functions they cannot show: given)."""
    given = {k: TINY[k] for k in ("num_queries", "num_denoising", "encoder_attention_heads")}
    ours = fastzoo.create("dfine_small_coco", pretrained=hf.state_dict(), **given)
    made = fastzoo.create("dfine_small_coco", **TINY).config
    for field in ("stem_channels", "stage_in_channels", "stage_mid_channels", "stage_out_channels", "stage_num_blocks",
                  "stage_numb_of_layers", "stage_light_block", "stage_kernel_size", "use_learnable_affine_block",
                  "backbone_out_indices", "encoder_in_channels", "encoder_hidden_dim", "d_model",
                  "decoder_layers", "decoder_n_points", "decoder_attention_heads", "max_num_bins", "top_prob_values",
                  "lqe_hidden_dim"):
        assert getattr(ours.config, field) == getattr(made, field), field
    for field in ("depth_mult", "hidden_expansion"):  # the weights show round(3 x depth_mult) and the ELAN width
        assert ours.config.compared(field) == made.compared(field), field
    compare_eval(hf, ours, batch(seed=8)[0])


def test_a_state_dict_missing_a_key_is_refused_naming_it(hf):
    state = dict(hf.state_dict())
    del state["model.decoder.lqe_layers.1.reg_conf.layers.0.weight"]
    with pytest.raises(CheckpointError, match=r"lqe_layers\.1\.reg_conf\.layers\.0\.weight"):
        fastzoo.create("dfine_small_coco", pretrained=state, **TINY)


@pytest.mark.parametrize("bad, field", [
    (dict(eval_idx=0), "eval_idx"),
    (dict(max_num_bins=7), "max_num_bins"),
    (dict(top_prob_values=10), "top_prob_values"),
    (dict(decoder_n_points=(2, 2)), "decoder_n_points"),
    (dict(stage_in_channels=(8, 16, 24, 30)), "stage_in_channels"),
    (dict(encoder_in_channels=(24, 32, 41)), "encoder_in_channels"),
    (dict(stem_channels=(1, 8, 8)), "stem_channels"),
    (dict(hidden_expansion=0.01), "hidden_expansion"),
])
def test_bad_configs_are_refused_by_name(bad, field):
    with pytest.raises(ConfigError, match=field):
        fastzoo.create("dfine_small_coco", **{**TINY, **bad})


def test_a_config_naming_a_backbone_to_load_is_refused_naming_it():
    """transformers' ``backbone="microsoft/resnet-18"`` without a ``backbone_config`` loads that backbone by name;
    fastzoo builds the HGNetV2 of ``backbone_config`` and refuses the name rather than build another."""
    from fastzoo.models.d_fine.convert import HF

    named = {"model_type": "d_fine", "backbone": "microsoft/resnet-18", "backbone_config": None,
             "use_pretrained_backbone": True}
    with pytest.raises(CheckpointError, match="backbone='microsoft/resnet-18'.*HGNetV2"):
        HF.config_from_json(named)


def test_unknown_forward_keywords_are_refused_naming_the_model():
    ours = fastzoo.create("dfine_small_coco", **TINY)
    with pytest.raises(ValueError, match="output_attentions: fastzoo's DFineForObjectDetection takes"):
        ours(pixel_values=batch()[0], output_attentions=True)


def test_names_give_their_sizes():
    cfg = fastzoo.create("ustc-community/dfine-xlarge-coco", device="meta").config
    assert (cfg.encoder_hidden_dim, cfg.decoder_n_points, cfg.reg_scale, cfg.stage_num_blocks) == (384, (3, 6, 3), 8.0,
                                                                                                    (1, 2, 5, 2))
