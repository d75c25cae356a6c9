"""transformers' call convention on fastzoo's image models (ViT, ResNet): ``model(pixel_values=,
labels=, output_hidden_states=, return_dict=)`` -> transformers' output classes, with ``.loss`` by
transformers' rule for image classification (``problem_type``: regression, single- or multi-label).

The architecture a model answers as is the ``architectures`` entry of the transformers config it
came from (``config.hf_config``: ``ViTForImageClassification``, ``Dinov2Model``,
``CLIPVisionModel``, ``ResNetForImageClassification``...); a model that did not come from
transformers answers as its classifier (``ImageClassifierOutput``) or, without a head, as its
base model (``BaseModelOutputWithPooling``). The model's own forward computes everything; this
module only reads its pieces into the output class, so the timm call on the same model stays
``model(images) -> logits``. transformers is imported when such a call is made.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from fastzoo.models.base import refuse_inputs

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
# tower classes whose pooler_output is the model's pooled features (forward_head(pre_logits=True))
_TOWERS = {"ViTModel", "DeiTModel", "Dinov2Model", "CLIPVisionModel", "SiglipVisionModel"}


def hf_architecture(config) -> str | None:
    """The transformers class a model stands in for (its config.json's ``architectures[0]``), or None."""
    hf = getattr(config, "hf_config", None) or {}
    archs = hf.get("architectures") or [None]
    return archs[0]


# keywords of transformers' vision forwards that fastzoo does not serve: refused when given, with what to do
_UNSERVED = {
    "output_attentions": "its attention kernels never materialise the attention weights; compare against "
                         "transformers with attn_implementation='eager' for them",
    "interpolate_pos_encoding": "the ViT is built for one image size; build it for yours with fastzoo.create(..., "
                                "img_size=N), which resamples the position embedding",
    "attention_mask": "an image model attends to every patch",
}


def _refuse(kwargs: dict) -> None:
    """Keywords left after the served ones: transformers' that fastzoo does not serve, when given (a
    value other than None / False), and any other, by name (:func:`~fastzoo.models.base.refuse_inputs`)."""
    for name in _UNSERVED:
        if name in kwargs:
            refuse_inputs("image model", {name: kwargs.pop(name)}, {}, why=_UNSERVED[name])
    refuse_inputs("image model", {}, kwargs)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, config, num_items_in_batch=None,
                        ignore_index: int = -100) -> torch.Tensor:
    """transformers' image-classification loss: ``problem_type`` from the config, else regression
    for one label, single-label cross-entropy for integer labels, multi-label BCE otherwise (and
    remembered in the config, as transformers does). ``num_items_in_batch`` (the Trainer's, under
    gradient accumulation): the summed cross-entropy divided by it."""
    num_labels = logits.shape[-1]
    hf = config.hf_config if getattr(config, "hf_config", None) is not None else {}
    problem = hf.get("problem_type")
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
        if getattr(config, "hf_config", None) is not None:
            config.hf_config["problem_type"] = problem
    if problem not in PROBLEM_TYPES:
        raise ValueError(f"problem_type={problem!r} (config.hf_config): choose one of {', '.join(PROBLEM_TYPES)}")
    labels = labels.to(logits.device)
    if problem == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if problem == "single_label_classification":
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), ignore_index=ignore_index,
                               reduction=reduction)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss
    return F.binary_cross_entropy_with_logits(logits, labels)


def _pixels(pixel_values, weight: torch.Tensor) -> torch.Tensor:
    if pixel_values is None:
        raise ValueError("pixel_values is required: a [B, C, H, W] float tensor of images")
    return pixel_values.to(weight.dtype) if pixel_values.is_floating_point() else pixel_values  # transformers casts


def _finish(out, return_dict):
    return out if return_dict is None or return_dict else out.to_tuple()


def _defaults(config, output_hidden_states, return_dict) -> tuple[bool, bool]:
    """transformers' rule: an argument left None takes the model config's value."""
    hf = getattr(config, "hf_config", None) or {}
    return (hf.get("output_hidden_states", False) if output_hidden_states is None else output_hidden_states,
            hf.get("return_dict", True) if return_dict is None else return_dict)


def vit_forward(model, pixel_values, labels=None, *, output_hidden_states=None, return_dict=None,
                bool_masked_pos=None, num_items_in_batch=None, **kwargs):
    """A fastzoo ViT called as the transformers class in its ``config.hf_config`` (see the module docstring)."""
    import transformers.modeling_outputs as outputs

    _refuse(kwargs)
    cfg = model.config
    output_hidden_states, return_dict = _defaults(cfg, output_hidden_states, return_dict)
    if bool_masked_pos is not None and model.mask_token is None:
        raise ValueError("bool_masked_pos=: this model has no mask token (config mask_token=False)")
    hidden = model.forward_blocks(_pixels(pixel_values, model.pos_embed), bool_masked_pos)
    x_BSD = model.norm(hidden[-1])
    states = tuple(hidden) if output_hidden_states else None
    arch = hf_architecture(cfg)
    if arch in _TOWERS or (arch is None and not cfg.num_classes):
        if labels is not None:
            raise ValueError(f"labels=: {arch or 'a model without a classifier head'} has no loss (transformers' "
                             f"neither); give it a head (num_classes=N) to train a classifier")
        pooled = model.forward_head(x_BSD, pre_logits=True) if cfg.global_pool and (model.pooler is not None or
                                                                                    arch != "ViTModel") else None
        out = outputs.BaseModelOutputWithPooling(last_hidden_state=x_BSD, pooler_output=pooled, hidden_states=states)
        return _finish(out, return_dict)
    if model.head_dist is not None:
        from transformers.models.deit.modeling_deit import DeiTForImageClassificationWithTeacherOutput

        if labels is not None:
            raise ValueError("labels=: DeiTForImageClassificationWithTeacher has no loss (transformers' neither); "
                             "fine-tune with one head: fastzoo.create(..., num_classes=N) replaces both")
        cls_logits, dist_logits = model.head(x_BSD[:, 0]), model.head_dist(x_BSD[:, 1])
        out = DeiTForImageClassificationWithTeacherOutput(logits=(cls_logits + dist_logits) / 2, cls_logits=cls_logits,
                                                          distillation_logits=dist_logits, hidden_states=states)
        return _finish(out, return_dict)
    logits = model.forward_head(x_BSD)
    loss = classification_loss(logits, labels, cfg, num_items_in_batch) if labels is not None else None
    return _finish(outputs.ImageClassifierOutput(loss=loss, logits=logits, hidden_states=states), return_dict)


def resnet_forward(model, pixel_values, labels=None, *, output_hidden_states=None, return_dict=None,
                   num_items_in_batch=None, **kwargs):
    """A fastzoo ResNet called as transformers' ``ResNetForImageClassification`` / ``ResNetModel``."""
    import transformers.modeling_outputs as outputs

    _refuse(kwargs)
    output_hidden_states, return_dict = _defaults(model.config, output_hidden_states, return_dict)
    x = model.maxpool(model._stem(_pixels(pixel_values, model.conv1.weight)))
    states = [x]
    for i in range(model.num_stages):
        states.append(model._stage(i, states[-1]))
    hidden = tuple(states) if output_hidden_states else None
    cfg = model.config
    if hf_architecture(cfg) == "ResNetModel" or (hf_architecture(cfg) is None and not cfg.num_classes):
        if labels is not None:
            raise ValueError("labels=: ResNetModel has no loss (transformers' neither); give it a head (num_classes=N)")
        out = outputs.BaseModelOutputWithPoolingAndNoAttention(last_hidden_state=states[-1],
                                                               pooler_output=F.adaptive_avg_pool2d(states[-1], 1),
                                                               hidden_states=hidden)
        return _finish(out, return_dict)
    logits = model.forward_head(states[-1])
    loss = classification_loss(logits, labels, cfg, num_items_in_batch) if labels is not None else None
    return _finish(outputs.ImageClassifierOutputWithNoAttention(loss=loss, logits=logits, hidden_states=hidden),
                   return_dict)


class TransformersCall:
    """transformers' call beside timm's and torchvision's: a call with keywords (``model(pixel_values=,
    labels=, ...)``) returns transformers' output class through ``hf_forward``; ``model(images)`` runs
    ``forward``. The choice lives in ``__call__``, so ``forward`` keeps the one-tensor signature that
    FX tracers (torchvision's ``create_feature_extractor``, timm's) and ``torch.compile`` see."""

    def __init_subclass__(cls, **kwargs):
        # transformers' Trainer reads the call's keywords from ``forward``'s signature (which columns to
        # keep, which are labels): it says what ``__call__`` takes; FX reads the code, not this
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            sig = inspect.signature(cls.forward)
            hf = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("pixel_values", "labels")]
            cls.forward.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *hf,
                                                                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

    def hf_forward(self, pixel_values, labels=None, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        if not kwargs or set(kwargs) == {"images_BCHW"}:
            return super().__call__(*args, **kwargs)
        pixel_values = kwargs.pop("pixel_values", None)
        if args:
            if pixel_values is not None or len(args) > 1:
                raise TypeError("give the images once: model(images) or model(pixel_values=images, ...)")
            pixel_values = args[0]
        return self.hf_forward(pixel_values, kwargs.pop("labels", None), **kwargs)
