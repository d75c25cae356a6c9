"""DETR (Carion et al. 2020, "End-to-End Object Detection with Transformers"), as transformers'
``DetrForObjectDetection``: its module names (``model.backbone.model``, ``model.input_projection``,
``model.query_position_embeddings``, ``model.encoder.layers.N.self_attn.q_proj`` ...,
``class_labels_classifier``, ``bbox_predictor``), so its state dicts load key for key.

The function, as transformers 5.17 computes it:

- a ResNet with frozen BatchNorm gives C5 (``backbone.py``); a 1x1 conv projects it to
  ``d_model``; the pixel mask, resized to C5 (nearest), marks the real feature positions;
- the sine position embedding (normalised cumulative sums of the mask, temperature 10000,
  ``d_model / 2`` features per axis, y first) is added to the queries and keys of every
  encoder self-attention and to the keys of every decoder cross-attention;
- post-norm encoder layers (self-attention, MLP); decoder layers (self-attention, cross-attention,
  MLP) start from zeros, the learned ``query_position_embeddings`` added to the queries and keys of
  self-attention and to the queries of cross-attention; a shared LayerNorm ends the decoder.
  With ``auxiliary_loss`` transformers applies that LayerNorm after *every* layer and feeds the
  normalised output to the next one (and once more at the end): so does this model;
- heads: ``class_labels_classifier`` (``num_labels`` + "no object") and ``bbox_predictor``, a
  3-layer MLP, sigmoid -> (cx, cy, w, h) in [0, 1] of the unpadded image.

The encoder and decoder layers live in ``transformer.py``.

Attention runs through the model's backend (``set_attention``), the pixel mask as a key-padding
mask. A backend without padding masks but with packed sequences (``varlen``, ``nested``) gets the
real feature positions only: the encoder runs on the unpadded tokens of each image, and the
decoder's cross-attention reads them with the images' own offsets (``cu_seqlens_k``).

The training-time clamp transformers applies to non-finite encoder outputs is applied without its
host read (a clamp to the dtype's range minus 1000 is the identity on finite values).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.attention import packing
from fastzoo.attention.base import AttnContext
from fastzoo.models.base import FastzooModel, refuse_inputs
from fastzoo.models.detr.backbone import DetrConvEncoder
from fastzoo.models.detr.config import DetrConfig
from fastzoo.models.timm_api import check_images

def sine_position_embedding(shape, dtype, device, d_model: int, mask_BHW: torch.Tensor | None,
                            offset: float = 0.0) -> torch.Tensor:
    """transformers' ``DetrSinePositionEmbedding(d_model // 2, normalize=True)``, flattened: ``[B, h*w, d_model]``.
    ``offset``: subtracted from the cumulative positions before they are normalised (Deformable DETR's 0.5:
    each position at its pixel's centre; DETR's 0)."""
    B, _, H, W = shape
    n = d_model // 2
    if mask_BHW is None:
        y_BHW = torch.arange(1, H + 1, dtype=dtype, device=device)[None, :, None].expand(B, H, W)
        x_BHW = torch.arange(1, W + 1, dtype=dtype, device=device)[None, None, :].expand(B, H, W)
    else:
        m = mask_BHW.to(dtype)
        y_BHW, x_BHW = m.cumsum(1), m.cumsum(2)
    y_BHW = (y_BHW - offset) / (y_BHW[:, -1:, :] + 1e-6) * (2 * math.pi)  # x - 0.0 is x: DETR's values exactly
    x_BHW = (x_BHW - offset) / (x_BHW[:, :, -1:] + 1e-6) * (2 * math.pi)
    dim_t = torch.arange(n, dtype=torch.int64, device=device).to(dtype)
    dim_t = 10000 ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / n)
    px, py = x_BHW[..., None] / dim_t, y_BHW[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), dim=4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((py, px), dim=3).flatten(1, 2)


class DetrEncoder(nn.Module):
    def __init__(self, cfg: DetrConfig):
        from fastzoo.models.detr.transformer import DetrEncoderLayer

        super().__init__()
        self.layers = nn.ModuleList(DetrEncoderLayer(cfg) for _ in range(cfg.encoder_layers))


class DetrDecoder(nn.Module):
    def __init__(self, cfg: DetrConfig):
        from fastzoo.models.detr.transformer import DetrDecoderLayer

        super().__init__()
        self.layers = nn.ModuleList(DetrDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layernorm = nn.LayerNorm(cfg.d_model)


class DetrModel(nn.Module):
    """transformers' ``DetrModel``: backbone, projection, encoder, decoder."""

    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.config = cfg
        self.backbone = DetrConvEncoder(cfg)
        self.query_position_embeddings = nn.Embedding(cfg.num_queries, cfg.d_model)
        self.input_projection = nn.Conv2d(cfg.hidden_sizes[-1], cfg.d_model, kernel_size=1)
        self.encoder = DetrEncoder(cfg)
        self.decoder = DetrDecoder(cfg)

    def forward(self, pixel_values, pixel_mask, packed: bool) -> torch.Tensor:
        """The decoder's output of every layer after the shared LayerNorm ``[L, B, Q, D]`` (L = 1
        without ``auxiliary_loss``: only the last)."""
        cfg = self.config
        f_BCHW, mask_BHW = self.backbone(pixel_values, pixel_mask)
        x_BSD = self.input_projection(f_BCHW).flatten(2).transpose(1, 2)
        pos_BSD = sine_position_embedding(f_BCHW.shape, pixel_values.dtype, pixel_values.device, cfg.d_model, mask_BHW)
        B = x_BSD.shape[0]
        mask_BS = None if mask_BHW is None else mask_BHW.flatten(1)
        x, pos, enc_ctx, cross_ctx = self._encoder_inputs(x_BSD, pos_BSD, mask_BS, packed)
        x = F.dropout(x, cfg.dropout, self.training)
        for layer in self.encoder.layers:
            x = layer(x, pos, enc_ctx)
        query_pos_BQD = self.query_position_embeddings.weight.unsqueeze(0).expand(B, -1, -1)
        h_BQD = torch.zeros_like(query_pos_BQD)
        self_ctx, outs = AttnContext(), []
        for layer in self.decoder.layers:
            h_BQD = layer(h_BQD, query_pos_BQD, x, pos, self_ctx, cross_ctx)
            if cfg.auxiliary_loss:
                h_BQD = self.decoder.layernorm(h_BQD)
                outs.append(h_BQD)
        h_BQD = self.decoder.layernorm(h_BQD)
        return torch.stack(outs[:-1] + [h_BQD]) if cfg.auxiliary_loss else h_BQD[None]

    def _encoder_inputs(self, x_BSD, pos_BSD, mask_BS, packed: bool):
        """The encoder's tokens, their position embedding and the contexts of the encoder's
        self-attention and the decoder's cross-attention: padded with the mask as a key-padding
        mask, or (``packed``) the real tokens only, packed, with each image's offsets."""
        B, S, _ = x_BSD.shape
        Q = self.config.num_queries
        if not packed:
            ctx = AttnContext(key_padding_mask=mask_BS)
            return x_BSD, pos_BSD, ctx, ctx
        if mask_BS is None:
            mask_BS = torch.ones(B, S, dtype=torch.bool, device=x_BSD.device)
        sizes = packing.mask_sizes(mask_BS).tolist()  # one host read: the kernels take max_seqlen as an int
        if sizes[1] != B:
            raise ValueError("pixel_mask: an image has no real pixel (a row of zeros); every image needs at least one")
        info, (x_TD, pos_TD) = packing.unpad(mask_BS, x_BSD, pos_BSD, sizes=sizes)
        enc_ctx = AttnContext(cu_seqlens=info.cu_seqlens, max_seqlen=info.max_seqlen)
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=x_BSD.device) * Q
        cross_ctx = AttnContext(cu_seqlens=cu_q, max_seqlen=Q, cu_seqlens_k=info.cu_seqlens, max_seqlen_k=info.max_seqlen)
        return x_TD[None], pos_TD[None], enc_ctx, cross_ctx


class DetrMLPPredictionHead(nn.Module):
    """transformers' box head: Linear layers, ReLU between."""

    def __init__(self, d: int, out: int, num_layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d if i < num_layers - 1 else out) for i in range(num_layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class TransformersDetector:
    """What transformers' ``Trainer`` and its tests ask of every detector of the family, written once for
    DETR, Deformable DETR, RT-DETR, D-FINE and RF-DETR (``checkpoint_stacks`` are ``GradientCheckpointingLayer`` s,
    or blocks run through ``models/rf_detr/backbone.py``'s ``run_block``): gradient checkpointing,
    ``num_parameters``, ``can_generate``, no input embeddings."""

    supports_gradient_checkpointing = True  # transformers' flag: gradient_checkpointing_enable below

    @classmethod
    def can_generate(cls) -> bool:  # transformers' question of every model: a detector does not generate
        return False

    def checkpoint_stacks(self) -> list[nn.ModuleList]:
        """The layer stacks gradient checkpointing recomputes: the encoder's and the decoder's."""
        return [self.model.encoder.layers, self.model.decoder.layers]

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1,
                                      offload: bool = False):
        """transformers' switch (its ``Trainer`` calls it with ``gradient_checkpointing=True``): the
        layers of ``checkpoint_stacks`` (every one, or every ``every_n_layers``-th of each) recompute their
        activations in the backward through ``torch.utils.checkpoint`` (non-reentrant unless
        ``gradient_checkpointing_kwargs`` says otherwise; RNG state kept, so dropout and the gradients
        are unchanged). The backbone keeps its activations, as in transformers. ``offload=True``
        (activations in pinned host memory) is refused."""
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        if offload:
            raise ValueError(f"offload=True: fastzoo's {type(self).__name__} does not offload checkpointed "
                             f"activations; leave it False")
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        self.check_checkpointing(non_reentrant=not kwargs["use_reentrant"])
        func = partial(checkpoint, **kwargs)
        for stack in self.checkpoint_stacks():
            for i, layer in enumerate(stack):
                layer._gradient_checkpointing_func = func
                layer.gradient_checkpointing = i % every_n_layers == 0

    def gradient_checkpointing_disable(self):
        for stack in self.checkpoint_stacks():
            for layer in stack:
                layer.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.modules())

    def attention_checkpointed(self) -> bool:
        return any(layer.gradient_checkpointing and not layer._gradient_checkpointing_func.keywords["use_reentrant"]
                   for stack in self.checkpoint_stacks() for layer in stack)

    def enable_input_require_grads(self):
        """transformers' (PEFT calls it with gradient checkpointing): the outputs of the input projections
        (``encoder_inputs``) require grad, so that with every weight below a layer frozen (adapters only),
        the reentrant checkpoint still sees an input that needs a gradient and passes the layer's gradients on."""
        self.disable_input_require_grads()
        self.__dict__["_require_grads_hooks"] = [m.register_forward_hook(_output_requires_grad)
                                                 for m in self.encoder_inputs()]

    def disable_input_require_grads(self):
        for hook in self.__dict__.pop("_require_grads_hooks", []):
            hook.remove()

    def get_input_embeddings(self):
        """transformers' answer for a detector: it has no input embeddings (its input is ``pixel_values``)."""
        raise NotImplementedError(f"{type(self).__name__} has no input embeddings: its input is pixel_values")

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' ``num_parameters`` (``Trainer`` counts FLOPs with it)."""
        skip = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if (p.requires_grad or not only_trainable) and id(p) not in skip)


class DetrForObjectDetection(TransformersDetector, FastzooModel):
    """DETR with transformers' call convention."""

    family = "detr"
    config_class = DetrConfig
    main_input_name = "pixel_values"
    sigmoid_classes = False  # a softmax over the classes and "no object"

    def __init__(self, cfg: DetrConfig):
        super().__init__()
        import transformers.modeling_outputs  # noqa: F401  (registers HF output classes as pytree nodes, see the decoders)

        self.config = cfg
        self.model = DetrModel(cfg)
        self.class_labels_classifier = nn.Linear(cfg.d_model, cfg.num_labels + 1)
        self.bbox_predictor = DetrMLPPredictionHead(cfg.d_model, 4)
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        init_outside_backbone(self)

    def encoder_inputs(self) -> list[nn.Module]:
        """The module whose output the encoder reads: the backbone's projection to d_model."""
        return [self.model.input_projection]

    def attention_needs(self) -> dict:
        return {"head_dim": self.config.d_model // self.config.encoder_attention_heads, "causal": False,
                "grid_2d": False, "padding_mask": True, "unpads": True}

    def packs(self) -> bool:
        """Whether the backend is served packed tokens (it has packed sequences but no padding mask)."""
        backend = self.attention_backend
        caps = getattr(backend, "capabilities", None)
        return caps is not None and not caps.padding_mask and caps.varlen

    def heads(self, h_LBQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class logits ``[L, B, Q, C+1]`` and boxes (cx, cy, w, h) ``[L, B, Q, 4]``."""
        return self.class_labels_classifier(h_LBQD), self.bbox_predictor(h_LBQD).sigmoid()

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None, decoder_attention_mask=None,
                encoder_outputs=None, inputs_embeds=None, decoder_inputs_embeds=None, labels: list[dict] | None = None,
                **kwargs):
        """transformers 5.17's ``DetrForObjectDetection.forward``, its keywords in its order:
        ``pixel_values [B, 3, H, W]``, ``pixel_mask [B, H, W]`` (1 = a real pixel, 0 = padding),
        ``labels``: per image a dict with ``class_labels [n]`` and ``boxes [n, 4]`` (cx, cy, w, h in
        [0, 1]; n may be 0). Returns transformers' ``DetrObjectDetectionOutput`` (``loss``,
        ``loss_dict``, ``logits``, ``pred_boxes``, ``auxiliary_outputs``, ``last_hidden_state``);
        ``return_dict=False`` gives its tuple. The loss is
        :func:`fastzoo.losses.set_prediction.set_prediction_loss` with this config's settings, normalised
        by the box count as transformers' (``num_items_in_batch``, which its Trainer passes, changes nothing
        there either). Refused by name (``ValueError``): ``decoder_attention_mask``, ``encoder_outputs``,
        ``inputs_embeds``, ``decoder_inputs_embeds`` given, ``output_attentions`` / ``output_hidden_states``
        true, and any other keyword."""
        from transformers.models.detr.modeling_detr import DetrObjectDetectionOutput

        from fastzoo.losses.set_prediction import set_prediction_loss

        return_dict = kwargs.pop("return_dict", None)
        kwargs.pop("num_items_in_batch", None)
        unserved = {"decoder_attention_mask": decoder_attention_mask, "encoder_outputs": encoder_outputs,
                    "inputs_embeds": inputs_embeds, "decoder_inputs_embeds": decoder_inputs_embeds,
                    **{k: kwargs.pop(k, None) for k in ("output_attentions", "output_hidden_states")}}
        refuse_inputs("DETR", unserved, kwargs, why="it runs the whole model from pixel_values (+ pixel_mask) and returns "
                      "no per-layer attentions or hidden states (the attention kernels never materialise the weights)")
        pixel_values, pixel_mask = _check_pixels(pixel_values, pixel_mask, self.config.num_channels,
                                                 self.class_labels_classifier.weight)
        h_LBQD = self.model(pixel_values, pixel_mask, self.packs())
        logits_LBQC, boxes_LBQ4 = self.heads(h_LBQD)
        loss = loss_dict = aux = None
        if labels is not None:
            loss, loss_dict = set_prediction_loss(logits_LBQC, boxes_LBQ4, labels, self.config)
            if self.config.auxiliary_loss:
                aux = [{"logits": c, "pred_boxes": b} for c, b in zip(logits_LBQC[:-1], boxes_LBQ4[:-1])]
        out = DetrObjectDetectionOutput(loss=loss, loss_dict=loss_dict, logits=logits_LBQC[-1], pred_boxes=boxes_LBQ4[-1],
                                        auxiliary_outputs=aux, last_hidden_state=h_LBQD[-1])
        return out if return_dict is not False else out.to_tuple()

    def adapt_checkpoint(self, state, changed):
        """``num_labels`` set against a checkpoint: a fresh class head (transformers' ``from_pretrained(...,
        num_labels=, ignore_mismatched_sizes=True)``); boxes, queries and the rest load."""
        if "num_labels" not in changed:
            return state, [], []
        had = state.pop("class_labels_classifier.weight").shape[0] - 1
        state.pop("class_labels_classifier.bias", None)
        return state, ["class_labels_classifier.weight", "class_labels_classifier.bias"], [
            f"num_labels={self.config.num_labels}: fresh class_labels_classifier (the checkpoint has {had} labels)"]

    def hf_config(self):
        """This architecture as a ``transformers.DetrConfig``."""
        from fastzoo.models.detr.convert import hf_config

        return hf_config(self.config)

    def save_pretrained(self, path, **_hf_options):
        """A directory ``transformers.DetrForObjectDetection.from_pretrained`` and fastzoo both read:
        transformers' ``config.json`` and ``model.safetensors`` in its keys (which are this model's),
        written atomically. transformers' own options are accepted and ignored."""
        from fastzoo.models.base import write_pretrained

        cfg = {**self.hf_config().to_dict(), "architectures": ["DetrForObjectDetection"]}
        return write_pretrained(path, cfg, self.state_dict(), weights_format="pt")


def _output_requires_grad(module, args, output):
    output.requires_grad_(True)


def _check_pixels(pixel_values, pixel_mask, channels: int, weight: torch.Tensor):
    """The images ``[B, C, H, W]`` (floating, on the device and in the dtype of ``weight`` unless under
    autocast) and their mask ``[B, H, W]`` (None when nothing is padded: read from the mask's values
    on the host only when it is given)."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4 or pixel_values.shape[1] != channels:
        raise ValueError(f"pixel_values must be a [B, {channels}, H, W] tensor, got "
                         f"{getattr(pixel_values, 'shape', type(pixel_values).__name__)}")
    check_images(pixel_values, channels, weight=weight)
    if pixel_mask is None:
        return pixel_values, None
    B, _, H, W = pixel_values.shape
    if not isinstance(pixel_mask, torch.Tensor) or tuple(pixel_mask.shape) != (B, H, W):
        raise ValueError(f"pixel_mask must be a [B, H, W] = [{B}, {H}, {W}] tensor (1 = real pixel), got "
                         f"{getattr(pixel_mask, 'shape', type(pixel_mask).__name__)}")
    return pixel_values, pixel_mask


def init_outside_backbone(model: nn.Module) -> None:
    """transformers' init of a DETR-family detector outside its backbone: normal(0, ``init_std``)
    Linear / Conv / Embedding weights and zero biases (a fresh model; never the compared state)."""
    std = model.config.init_std
    for name, m in model.named_modules():
        if name.startswith("model.backbone"):
            continue
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
