"""DETR's gradient checkpointing, transformers' switch (``gradient_checkpointing_enable``): the
encoder and decoder layers recompute their activations in the backward, and every gradient equals
the run that kept them (dropout on: the recompute draws the same masks), for both variants of
``torch.utils.checkpoint``, on padded and packed (varlen) encoder tokens, and for the reentrant one
on jagged NestedTensors (nested refuses the non-reentrant one: tests/test_fuzz_found.py); with
transformers' ``Trainer`` it trains the steps the plain model trains."""
import copy

import pytest
import torch
from conftest import SPECS
from detection_checks import boxes_labels, grads

import fastzoo

TINY = dict(SPECS["detr"].tiny)
# the same ops recomputed from the same inputs and RNG state: equal up to float rounding of the
# backward's accumulation order (reentrant sums a layer's gradients in another order: observed 2e-7
# of the largest gradient, fp32's epsilon 1.2e-7); relative to the largest gradient, since some are
# 0 in exact arithmetic (a key projection's bias: softmax ignores a shift) and only rounding there
GRAD_RTOL = 1e-6


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, 48, 64, generator=g)
    mask = torch.ones(3, 48, 64, dtype=torch.long)
    mask[1, :, 40:] = 0
    mask[2, 32:, :] = 0
    return x, mask, boxes_labels((2, 0, 5), TINY["num_labels"], g)


def _grads(model, seed=0):
    x, mask, labels = _batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's masks
    out = model(pixel_values=x, pixel_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), grads(model)


def _model(attn="sdpa"):
    torch.manual_seed(0)
    return fastzoo.create("detr", **TINY, attn=attn, dropout=0.1, auxiliary_loss=True, freeze_backbone="none").train()


@pytest.mark.parametrize("attn, reentrant", [("sdpa", False), ("sdpa", True), ("varlen", False), ("varlen", True),
                                             ("nested", True)])
def test_gradients_equal_the_run_without_checkpointing(attn, reentrant):
    plain = _model(attn)
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    for layer in [*ckpt.model.encoder.layers, *ckpt.model.decoder.layers]:
        layer.register_forward_pre_hook(lambda m, a: calls.append(m))
    loss_ref, ref = _grads(plain)
    loss, got = _grads(ckpt)
    layers = TINY["encoder_layers"] + TINY["decoder_layers"]
    assert len(calls) == 2 * layers  # each layer ran again in the backward
    assert torch.equal(loss, loss_ref)
    assert set(got) == set(ref) and any("backbone" in n for n in ref) and any("encoder" in n for n in ref)
    scale = max(float(g.abs().max()) for g in ref.values())
    err = {n: float((ref[n] - got[n]).abs().max()) / scale for n in ref}
    worst = max(err, key=err.get)
    assert err[worst] <= GRAD_RTOL, (worst, err[worst])


def test_adapters_only_train_through_reentrant_checkpointing_with_input_require_grads():
    """PEFT's set-up: every weight frozen but the attention's query projections; the reentrant
    checkpoint sees no input needing a gradient unless enable_input_require_grads marks one."""
    plain = _model()
    for n, p in plain.named_parameters():
        p.requires_grad_(n.endswith("q_proj.weight"))
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, ref = _grads(plain)
    ckpt.enable_input_require_grads()
    _, got = _grads(ckpt)
    assert set(got) == set(ref) and len(ref) == 2 * TINY["decoder_layers"] + TINY["encoder_layers"]
    assert all(torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-7) for n in ref)
    ckpt.disable_input_require_grads()
    # without it no layer's input needs a gradient: torch warns, and nothing upstream of the loss trains
    with pytest.warns(UserWarning, match="requires_grad"), pytest.raises(RuntimeError, match="does not require grad"):
        _grads(ckpt)


def test_switch_as_transformers_and_its_config_field():
    model = _model()
    assert type(model).supports_gradient_checkpointing and not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.encoder.layers] == [True, False]
    assert model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    assert fastzoo.create("detr", **TINY, gradient_checkpointing=True).is_gradient_checkpointing
    with pytest.raises(ValueError, match="offload"):
        model.gradient_checkpointing_enable(offload=True)
    with pytest.raises(ValueError, match="every_n_layers"):
        model.gradient_checkpointing_enable(every_n_layers=0)


def test_no_recompute_outside_training():
    model = _model()
    model.gradient_checkpointing_enable()
    calls = []
    model.model.encoder.layers[0].register_forward_pre_hook(lambda m, a: calls.append(m))
    x, mask, labels = _batch()
    with torch.no_grad():
        model(pixel_values=x, pixel_mask=mask, labels=labels)
    model.eval()
    model(pixel_values=x, pixel_mask=mask, labels=labels).loss.backward()
    assert len(calls) == 2  # once per forward: nothing recomputed without grad mode or in eval


def test_transformers_trainer_with_gradient_checkpointing_trains_as_without(tmp_path):
    """``TrainingArguments(gradient_checkpointing=True)`` calls the switch; the losses of 2 steps
    equal those of the plain model's from the same weights."""
    transformers = pytest.importorskip("transformers")
    x, mask, labels = _batch()
    rows = [{"pixel_values": x[i], "pixel_mask": mask[i], "labels": labels[i]} for i in range(3)]

    def collate(batch):
        return {"pixel_values": torch.stack([b["pixel_values"] for b in batch]),
                "pixel_mask": torch.stack([b["pixel_mask"] for b in batch]), "labels": [b["labels"] for b in batch]}

    losses = {}
    for ckpt in (False, True):
        model = _model()
        args = transformers.TrainingArguments(tmp_path / str(ckpt), per_device_train_batch_size=3, max_steps=2,
                                              learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                              gradient_checkpointing=ckpt, use_cpu=True, seed=0,
                                              remove_unused_columns=False, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
        trainer.train()
        assert model.is_gradient_checkpointing == ckpt
        losses[ckpt] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[True]) == 2 and losses[True] == pytest.approx(losses[False], abs=1e-6)
