"""timm's model API on fastzoo's image classifiers (ViT, ResNet): what timm's tools read.

``timm.data.resolve_data_config`` reads ``pretrained_cfg``; ``timm.optim.create_optimizer_v2``
reads ``no_weight_decay`` and, for layer decay, ``group_matcher``; ``timm.utils.ModelEmaV3``
deep-copies the model; ``features_only`` wraps it in timm's own ``FeatureListNet`` /
``FeatureGetterNet``. The answers must be timm's on the same weights, so the parts that are
timm's data (pretrained configs, index rules) are taken from timm itself, imported when asked.

Input checks run outside traced graphs: :func:`check_images` is registered with
``torch.fx.wrap`` by each model file, so symbolic tracing (torchvision's
``create_feature_extractor``) records it as one opaque call that still runs, and
``torch.export`` / ``torch.compile`` see only comparisons of static sizes.
"""
from __future__ import annotations

import torch

# the fields of timm's pretrained_cfg that say where weights came from and how that file is read
# (custom_load: a JAX .npz), not how to use them
_SOURCE_FIELDS = ("url", "file", "state_dict", "hf_hub_id", "hf_hub_filename", "source", "custom_load")


def check_images(images_BCHW: torch.Tensor, in_chans: int, img_size: tuple[int, int] | None = None,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """``images_BCHW`` unchanged, or a ValueError naming what is wrong with it. ``weight``: the
    first layer's, whose device and dtype the images must have (any floating dtype under
    autocast, which casts both to its own)."""
    if not isinstance(images_BCHW, torch.Tensor):
        raise ValueError(f"images must be a torch.Tensor [B, C, H, W], got {type(images_BCHW).__name__}")
    if images_BCHW.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images_BCHW.shape)}")
    if images_BCHW.shape[1] != in_chans:
        raise ValueError(f"images have {images_BCHW.shape[1]} channels, the model was built for in_chans={in_chans}")
    if not images_BCHW.is_floating_point():
        raise ValueError(f"images are {images_BCHW.dtype}: convert them to a floating dtype (and normalise) first")
    if weight is not None and images_BCHW.device != weight.device:
        raise ValueError(f"images are on {images_BCHW.device} but the model is on {weight.device}: "
                         f"move one of them (images.to({str(weight.device)!r}) or model.to(...))")
    if weight is not None and images_BCHW.dtype != weight.dtype and not torch.is_autocast_enabled(images_BCHW.device.type):
        raise ValueError(f"images are {images_BCHW.dtype} but the model's weights are {weight.dtype}: convert the images "
                         f"(images.to({weight.dtype})) or the model (model.to({images_BCHW.dtype})), or run under "
                         f"torch.autocast")
    if img_size is not None and tuple(images_BCHW.shape[2:]) != tuple(img_size):
        H, W = images_BCHW.shape[2:]
        raise ValueError(f"images are {H}x{W}, the model was built for img_size={tuple(img_size)}")
    return images_BCHW


def timm_pretrained_cfg(architecture: str) -> dict:
    """The pretrained_cfg ``timm.create_model(architecture)`` carries: its default tag's."""
    from timm.models import resolve_pretrained_cfg

    return resolve_pretrained_cfg(architecture).to_dict()


def portable_pretrained_cfg(cfg: dict) -> dict:
    """``cfg`` without where the weights came from (a url, a file, a hub id): what a
    ``save_pretrained`` directory carries, so timm loads the directory's own weights."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items() if k not in _SOURCE_FIELDS}


def take_indices(num: int, indices) -> tuple[list[int], int]:
    """timm's rule for ``forward_intermediates(indices=...)``: None all, an int the last n,
    a sequence those (negative from the end); also the largest. Out of range: ValueError."""
    if indices is None:
        indices = num
    if isinstance(indices, int):
        if not 0 < indices <= num:
            raise ValueError(f"indices={indices}: take the last n of {num} with 1 <= n <= {num}")
        taken = list(range(num - indices, num))
    else:
        taken = [num + i if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, taken) if not 0 <= t < num]
        if bad or not taken:
            raise ValueError(f"indices={list(indices)}: each must be in [-{num}, {num - 1}] and there must be at least one")
    return taken, max(taken)


class TimmModelAPI:
    """Mixin: ``pretrained_cfg`` (alias ``default_cfg``), ``num_classes``, ``num_features``,
    ``head_hidden_size`` and gradient checkpointing, as timm models carry them.

    ``pretrained_cfg`` is set by ``fastzoo.create``: the checkpoint's own (a live timm model's,
    a ``save_pretrained`` directory's) else timm's default for the named variant
    (``vit_b16`` -> ``vit_base_patch16_224``'s default tag). A model built without a name gets
    ``timm_architecture``'s default.
    """

    timm_architecture: str = ""  # the timm model a bare instance describes (subclasses set it)
    grad_checkpointing: bool = False
    main_input_name = "pixel_values"  # transformers' name of the input (its Trainer and pipelines read it)
    supports_gradient_checkpointing = True  # transformers' flag (gradient_checkpointing_enable below)

    @classmethod
    def can_generate(cls) -> bool:  # transformers asks every model: an image model does not generate
        return False

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count (``exclude_embeddings``: an image model has no token embedding to exclude)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    @property
    def pretrained_cfg(self) -> dict:
        cfg = self.__dict__.get("_pretrained_cfg")
        if cfg is None:
            cfg = self.__dict__["_pretrained_cfg"] = timm_pretrained_cfg(self.timm_architecture)
        return cfg

    @pretrained_cfg.setter
    def pretrained_cfg(self, cfg: dict) -> None:
        self.__dict__["_pretrained_cfg"] = dict(cfg)

    default_cfg = pretrained_cfg  # timm's older name, same object

    @property
    def num_classes(self) -> int:
        return self.config.num_classes

    @property
    def num_features(self) -> int:
        return self.config.num_features

    head_hidden_size = num_features  # timm: the width forward_head(pre_logits=True) returns

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (timm's
        ``checkpoint_seq``: non-reentrant, RNG state kept, so gradients are unchanged)."""
        self.check_checkpointing(non_reentrant=bool(enable))
        self.grad_checkpointing = bool(enable)

    def attention_checkpointed(self) -> bool:
        return self.grad_checkpointing

    def _run_block(self, block, *args):
        if self.grad_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """transformers' name (its Trainer calls it with ``gradient_checkpointing=True``): non-reentrant
        checkpointing of each block, whatever ``use_reentrant`` the kwargs ask."""
        self.set_grad_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self.set_grad_checkpointing(False)

    def hf_pretrained(self) -> tuple[dict, dict]:
        """transformers' ``config.json`` and state dict of this model (families that have a transformers form)."""
        raise NotImplementedError

    def save_pretrained(self, path, **_hf_options):
        """A model that came from transformers (``config.hf_config``) is written as transformers writes
        it: its config.json and ``model.safetensors`` in its keys, which ``from_pretrained`` of its
        class and fastzoo both read; any other as fastzoo's (:meth:`FastzooModel.save_pretrained`,
        with timm's hub config). transformers' own options (``safe_serialization``,
        ``max_shard_size`` ...) are accepted and ignored: the weights are always one safetensors file."""
        if getattr(self.config, "hf_config", None) is None:
            return super().save_pretrained(path)
        from fastzoo.models.base import write_pretrained

        config, state = self.hf_pretrained()
        return write_pretrained(path, config, state, weights_format="pt")

    def timm_model_args(self) -> dict | None:
        """Keyword arguments that make ``timm.create_model(architecture, ...)`` this network, or
        None where timm cannot be told (then timm gets no architecture, rather than another one)."""
        raise NotImplementedError

    def extra_config(self) -> dict:
        """timm's hub config (``architecture``, ``num_classes``, ``num_features``, ``global_pool``,
        ``pretrained_cfg``, ``model_args``), so ``timm.create_model("local-dir:" + path)`` builds
        this network from a ``save_pretrained`` directory with its preprocessing."""
        # the classes of these weights: timm re-initialises a classifier whose size differs from the cfg's
        cfg = {**portable_pretrained_cfg(self.pretrained_cfg), "num_classes": self.num_classes}
        model_args = self.timm_model_args()
        out = {"pretrained_cfg": cfg, "num_features": self.num_features}
        if model_args is not None and cfg.get("architecture"):
            out.update(architecture=cfg["architecture"], model_args=model_args)
        return out

    def as_features(self, out_indices=None, feature_cls: str | None = None, **kwargs):
        """timm's ``features_only=True`` result around this model: the list of feature maps at
        ``out_indices`` (indices into ``feature_info``), from timm's own wrapper class
        (``feature_cls``: timm's names; 'hook' and 'fx' find the modules ``feature_info`` names)."""
        from timm.models import _features, _features_fx
        from timm.models._builder import pretrained_cfg_for_features

        kinds = {"list": _features.FeatureListNet, "getter": _features.FeatureGetterNet, "dict": _features.FeatureDictNet,
                 "hook": _features.FeatureHookNet, "fx": _features_fx.FeatureGraphNet}
        kind = feature_cls or self.timm_feature_cls
        if kind not in kinds:
            raise ValueError(f"feature_cls={kind!r}: choose one of {', '.join(map(repr, kinds))}")
        if out_indices is None:
            out_indices = self.default_out_indices
        cfg = self.pretrained_cfg
        wrapped = kinds[kind](self, out_indices=out_indices, **kwargs)
        wrapped.pretrained_cfg = wrapped.default_cfg = pretrained_cfg_for_features(cfg)
        return wrapped
