"""DETR's set loss per training step (matcher + every term, all decoder layers, forward + backward):
transformers' ``ForObjectDetectionLoss`` (the peer) vs fastzoo's
:func:`~fastzoo.losses.set_prediction.set_prediction_loss` in each ``giou_impl``, on the same logits and
boxes of 6 decoder layers (auxiliary loss), 100 queries, 91 classes, 1-50 boxes per image; Deformable DETR's
(``DEFORMABLE_SETTING``: sigmoid classes, the focal term and cost, 300 queries) against transformers'
``DeformableDetrForObjectDetectionLoss``; and RT-DETR's
(:func:`rt_detr_suite`): transformers' ``RTDetrForObjectDetectionLoss`` vs
:func:`~fastzoo.losses.set_prediction.rt_detr_loss` on 6 decoder layers of 300 queries with the denoising
queries of a training step (transformers' own group builder, 100 denoising queries), the encoder's 300
proposals, 80 classes.

Beside the time, each case's host reads per step are counted (:class:`HostReads`): the reads of
device data a CUDA device would wait for (``.item()``, ``bool()``, ``.cpu()``, ``.tolist()``,
``nonzero``, boolean-mask indexing...), counted on any device by following which tensors are
already on the host (copies to the host and what is computed from host tensors only, tensors made
from numpy or lists without a ``device=``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fastzoo.bench.harness import Case, Group, Step, Suite


@dataclass(frozen=True)
class SetLossSetting:
    name: str
    images: int
    queries: int = 100
    max_boxes: int = 50
    layers: int = 6
    num_classes: int = 91  # COCO's label ids, as DETR
    focal_alpha: float | None = None  # Deformable DETR's sigmoid classes, focal term and cost; None: DETR's softmax

    def describe(self) -> str:
        return (f"{self.images} images x {self.queries} queries, 1-{self.max_boxes} boxes per image, "
                f"{self.layers} decoder layers (auxiliary loss), {self.num_classes} classes"
                + ("" if self.focal_alpha is None else f", sigmoid focal term (alpha {self.focal_alpha})"))


TARGET_SETTING = SetLossSetting("8 images", 8)
LARGE_SETTING = SetLossSetting("32 images", 32)
DEFORMABLE_SETTING = SetLossSetting("8 images", 8, queries=300, focal_alpha=0.25)  # DeformableDetrConfig's defaults
BATCH_FIELD = "images"  # the setting's field --batch-size sets
GIOU_IMPLS = ("kernel", "padded", "concat", "per_sample")  # the order of the table


class HostReads(TorchFunctionMode):
    """Counts the reads of device data (see the module docstring) while active: ``.count``."""

    READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__",
             "nonzero", "masked_select", "unique", "repeat_interleave"}
    FROM_HOST = {"as_tensor", "from_numpy", "tensor"}

    def __init__(self):
        super().__init__()
        self.count = 0
        self._host: dict[int, object] = {}  # id -> tensor, tensors whose values are on the host

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._host.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        host_in = bool(tensors) and all(self._is_host(t) for t in tensors)  # mixed with device data: on the device
        bool_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool and not self._is_host(t) for t in flat[1:])
        if (name in self.READS and tensors and not self._is_host(tensors[0])) or bool_index:
            self.count += 1
        out = func(*args, **kwargs)
        to_device = name in ("to", "cuda") and not (args[1:] and args[1] in ("cpu", torch.device("cpu")))
        if not to_device and (host_in or name in ("cpu", "numpy") or (name in self.FROM_HOST and not tensors and "device" not in kwargs)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[id(t)] = t
        return out


def host_reads(fn) -> int:
    """Host reads of one call of ``fn``."""
    with HostReads() as mode:
        fn()
    return mode.count


def make_labels(images: int, max_boxes: int, num_classes: int, g: torch.Generator, device):
    """transformers' labels of ``images`` images with 1 to ``max_boxes`` boxes each, and the counts."""
    counts = torch.randint(1, max_boxes + 1, (images,), generator=g).tolist()
    labels = []
    for n in counts:
        c, wh = torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.02
        labels.append({"class_labels": torch.randint(0, num_classes, (n,), generator=g).to(device),
                       "boxes": torch.cat([c, wh], 1).to(device)})
    return labels, counts


def make_inputs(s: SetLossSetting, device, seed: int = 0):
    """Raw (pre-sigmoid) box outputs and logits ``[L, B, Q, ...]`` and transformers' labels."""
    g = torch.Generator().manual_seed(seed)
    labels, counts = make_labels(s.images, s.max_boxes, s.num_classes, g, device)
    classes = s.num_classes + (s.focal_alpha is None)  # softmax: a last "no object" class
    logits = torch.randn(s.layers, s.images, s.queries, classes, generator=g).to(device)
    raw = (torch.randn(s.layers, s.images, s.queries, 4, generator=g) * 1.5).to(device)
    return logits, raw, labels, counts


def hf_config(s: SetLossSetting):
    """The loss's fields of transformers' DetrConfig / DeformableDetrConfig (their defaults), auxiliary loss on."""
    return SimpleNamespace(num_labels=s.num_classes, class_cost=1, bbox_cost=5, giou_cost=2, bbox_loss_coefficient=5,
                           giou_loss_coefficient=2, eos_coefficient=0.1, auxiliary_loss=True, decoder_layers=s.layers,
                           focal_alpha=s.focal_alpha)


def hf_loss(logits, boxes, labels, cfg):
    from transformers.loss.loss_deformable_detr import DeformableDetrForObjectDetectionLoss
    from transformers.loss.loss_for_object_detection import ForObjectDetectionLoss

    loss_fn = ForObjectDetectionLoss if cfg.focal_alpha is None else DeformableDetrForObjectDetectionLoss
    loss, _, _ = loss_fn(logits[-1], labels, logits.device, boxes[-1], cfg, outputs_class=logits, outputs_coord=boxes)
    return loss


def fastzoo_loss(giou_impl: str):
    from fastzoo.losses.set_prediction import set_prediction_loss

    def loss_of(logits, boxes, labels, cfg):
        return set_prediction_loss(logits, boxes, labels, num_classes=cfg.num_labels, giou_impl=giou_impl,
                                   focal_alpha=cfg.focal_alpha)[0]

    return loss_of


def loss_step(loss_of, logits0, raw0, labels, cfg, items: int) -> Step:
    logits, raw = logits0.clone().requires_grad_(), raw0.clone().requires_grad_()

    def run():
        logits.grad = raw.grad = None
        loss = loss_of(logits, raw.sigmoid(), labels, cfg)
        loss.backward()
        return loss

    def outputs():
        loss = run()
        return {"output": loss.detach()[None], "grad:logits": logits.grad.clone(), "grad:boxes": raw.grad.clone()}

    return Step(run=run, items=items, outputs=outputs)


def set_loss_suite(setting: SetLossSetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32, seed: int = 0,
                   giou_impls=GIOU_IMPLS) -> Suite:
    device, s = torch.device(device), setting
    logits, raw, labels, counts = make_inputs(s, device, seed)
    cfg = hf_config(s)
    peer = "ForObjectDetectionLoss" if s.focal_alpha is None else "DeformableDetrForObjectDetectionLoss"
    losses = {f"transformers {peer} ([B*Q, N] cost per layer, N x N GIoU)": hf_loss,
              **{f"fastzoo set_prediction_loss, GIoU {m}": fastzoo_loss(m) for m in giou_impls}}
    reads = {short: host_reads(loss_step(loss_of, logits, raw, labels, cfg, s.images).run)
             for short, loss_of in zip(["transformers", *(f"fastzoo {m}" for m in giou_impls)], losses.values())}
    cases = [Case(label, lambda f=loss_of: loss_step(f, logits, raw, labels, cfg, s.images), peer=i == 0,
                  reference=i == 0) for i, (label, loss_of) in enumerate(losses.items())]
    what = "set loss" if s.focal_alpha is None else "Deformable DETR set loss (focal)"
    group = Group(f"{s.name} | {what}, {s.layers} layers, forward + backward", cases, unit="images/s",
                  reference=lambda: loss_step(hf_loss, logits, raw, labels, cfg, s.images).outputs())
    config = {"batch": s.describe(), "real boxes": sum(counts),
              "host reads per step": reads}
    return Suite("set_loss" if s.focal_alpha is None else "deformable_detr_loss", [group], config=config, device=device)


@dataclass(frozen=True)
class RTDetrLossSetting:
    name: str
    images: int
    queries: int = 300
    max_boxes: int = 50
    layers: int = 6
    num_classes: int = 80  # COCO's classes, as RT-DETR's checkpoints
    num_denoising: int = 100  # RTDetrConfig's default

    def describe(self) -> str:
        return (f"{self.images} images x {self.queries} queries (+ denoising: {self.num_denoising} queries' worth of "
                f"groups), 1-{self.max_boxes} boxes per image, {self.layers} decoder layers + the encoder's proposals, "
                f"{self.num_classes} classes")


RT_DETR_SETTING = RTDetrLossSetting("8 images", 8)


def rt_detr_inputs(s: RTDetrLossSetting, device, seed: int = 0):
    """RT-DETR's decoder outputs in training (the denoising queries first), the encoder's proposals (raw boxes,
    before the sigmoid), transformers' labels and its denoising metadata (its own builder, seeded)."""
    from transformers.models.rt_detr.modeling_rt_detr import get_contrastive_denoising_training_group

    g = torch.Generator().manual_seed(seed)
    labels, _ = make_labels(s.images, s.max_boxes, s.num_classes, g, device)
    torch.manual_seed(seed)
    _, _, _, meta = get_contrastive_denoising_training_group(
        labels, s.num_classes, s.queries, torch.nn.Embedding(s.num_classes + 1, 8).to(device),
        num_denoising_queries=s.num_denoising, label_noise_ratio=0.5, box_noise_scale=1.0)
    Q = sum(meta["dn_num_split"])
    outputs = {"logits": torch.randn(s.layers, s.images, Q, s.num_classes, generator=g).to(device),
               "boxes": (torch.randn(s.layers, s.images, Q, 4, generator=g) * 1.5).to(device),
               "enc_logits": torch.randn(s.images, s.queries, s.num_classes, generator=g).to(device),
               "enc_boxes": (torch.randn(s.images, s.queries, 4, generator=g) * 1.5).to(device)}
    return outputs, labels, meta


def rt_detr_hf_loss(o, labels, meta, cfg):
    from transformers.loss.loss_rt_detr import RTDetrForObjectDetectionLoss

    loss, _, _ = RTDetrForObjectDetectionLoss(
        o["logits"][-1], labels, o["logits"].device, o["boxes"][-1], cfg, o["logits"].transpose(0, 1),
        o["boxes"].transpose(0, 1), enc_topk_logits=o["enc_logits"], enc_topk_bboxes=o["enc_boxes"],
        denoising_meta_values=meta)
    return loss


def rt_detr_fastzoo_loss(giou_impl: str):
    from fastzoo.losses.set_prediction import rt_detr_loss

    def loss_of(o, labels, meta, cfg):
        cfg.giou_impl = giou_impl
        return rt_detr_loss(o["logits"], o["boxes"], labels, cfg, enc_topk_logits=o["enc_logits"],
                            enc_topk_bboxes=o["enc_boxes"], denoising_meta_values=meta)[0]

    return loss_of


def rt_detr_step(loss_of, outputs0, labels, meta, cfg, items: int) -> Step:
    leaves = {k: v.clone().requires_grad_() for k, v in outputs0.items()}

    def run():
        for v in leaves.values():
            v.grad = None
        o = {**leaves, "boxes": leaves["boxes"].sigmoid(), "enc_boxes": leaves["enc_boxes"].sigmoid()}
        loss = loss_of(o, labels, meta, cfg)
        loss.backward()
        return loss

    def outputs():
        loss = run()
        return {"output": loss.detach()[None], **{f"grad:{k}": v.grad.clone() for k, v in leaves.items()}}

    return Step(run=run, items=items, outputs=outputs)


def rt_detr_suite(setting: RTDetrLossSetting = RT_DETR_SETTING, *, device="cpu", seed: int = 0,
                  giou_impls=GIOU_IMPLS) -> Suite:
    """RT-DETR's set loss per training step (every term of every layer, denoising included, forward + backward)."""
    from transformers import RTDetrConfig

    device, s = torch.device(device), setting
    outputs, labels, meta = rt_detr_inputs(s, device, seed)
    cfg = RTDetrConfig(num_labels=s.num_classes, num_queries=s.queries, decoder_layers=s.layers,
                       num_denoising=s.num_denoising)  # the loss's fields at transformers' defaults
    losses = {"transformers RTDetrForObjectDetectionLoss": rt_detr_hf_loss,
              **{f"fastzoo rt_detr_loss, GIoU {m}": rt_detr_fastzoo_loss(m) for m in giou_impls}}
    reads = {short: host_reads(rt_detr_step(loss_of, outputs, labels, meta, cfg, s.images).run)
             for short, loss_of in zip(["transformers", *(f"fastzoo {m}" for m in giou_impls)], losses.values())}
    cases = [Case(label, lambda f=loss_of: rt_detr_step(f, outputs, labels, meta, cfg, s.images), peer=i == 0,
                  reference=i == 0) for i, (label, loss_of) in enumerate(losses.items())]
    group = Group(f"{s.name} | RT-DETR set loss, {s.layers} layers + encoder + denoising, forward + backward", cases,
                  unit="images/s", reference=lambda: rt_detr_step(rt_detr_hf_loss, outputs, labels, meta, cfg,
                                                                  s.images).outputs())
    config = {"batch": s.describe(), "real boxes": sum(len(t["boxes"]) for t in labels),
              "denoising": f"{meta['dn_num_group']} groups, {meta['dn_num_split'][0]} queries",
              "host reads per step": reads}
    return Suite("rt_detr_loss", [group], config=config, device=device)


def cli_suite(setting, *, device, dtype) -> Suite:
    return set_loss_suite(setting, device=device, dtype=dtype)
