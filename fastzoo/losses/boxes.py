"""Box targets in every layout the GIoU loss takes. Images hold different numbers of boxes
(zero is legal).

:func:`collate_boxes` builds, on the CPU and in one go, the three layouts the GIoU loss
modes take (``fastzoo/losses/giou.py``):

- concatenated + counts: ``boxes [N, 4]``, ``labels [N]``, ``batch_index [N]``, ``counts``;
- padded + mask: ``padded [B, M, 4]`` (padding holds ``PAD_BOX``, an inverted box, so the
  padded targets alone say which slots are real), ``padded_labels [B, M]`` (-1 in padding),
  ``mask [B, M]``;
- list of tensors: ``per_image()``, views into the concatenated tensor.

So a batch moves to the GPU as a handful of tensors (``.to(device, non_blocking=True)``
after ``pin_memory()``, which the DataLoader calls), never one copy per image, and the
list layout costs no copy at all. Boxes are validated here, on the CPU, where it costs
no device sync; the losses can then skip value checks (``validate=False``), and with
``num_classes=`` the labels are checked here too (``checked_classes``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from fastzoo.losses.giou import PAD_BOX, check_boxes, first_bad_box


@dataclass
class BoxTargets:
    counts: tuple[int, ...]  # boxes per image, kept on the host: splitting never syncs
    boxes: Tensor  # [N, 4] xyxy, all images concatenated
    labels: Tensor  # [N] int64
    batch_index: Tensor  # [N] int64: image of each box
    slot: Tensor  # [N] int64: position of each box in its image (its column in ``padded``)
    padded: Tensor  # [B, M, 4], PAD_BOX (an inverted box) in padding: giou_loss_padded reads validity from it
    padded_labels: Tensor  # [B, M], -1 in padding
    mask: Tensor  # [B, M] bool, True = a real box
    checked_classes: int | None = None  # labels were checked to lie in [0, checked_classes) (on the CPU)

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def num_boxes(self) -> int:
        return self.boxes.shape[0]

    def per_image(self) -> list[Tensor]:
        """[n_i, 4] per image: views of ``boxes``."""
        return list(self.boxes.split(self.counts))

    def labels_per_image(self) -> list[Tensor]:
        return list(self.labels.split(self.counts))

    def _map(self, fn) -> "BoxTargets":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def to(self, device, non_blocking: bool = False) -> "BoxTargets":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "BoxTargets":  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


# A NaN capture saves the batch (``fastzoo/train/nan_guard.py``) and reads it back with
# torch.load(weights_only=True): BoxTargets holds only tensors and ints, so it may be unpickled.
torch.serialization.add_safe_globals([BoxTargets])


def collate_boxes(
    boxes: Sequence[Tensor], labels: Sequence[Tensor] | None = None, *, pad_to: int | None = None, validate: bool = True,
    num_classes: int | None = None, normalized: bool = False,
) -> BoxTargets:
    """All three layouts of per-image boxes ``[n_i, 4]`` (xyxy) and optional labels ``[n_i]``
    (default: class 0). ``pad_to`` fixes M (static shapes, e.g. for torch.compile).
    ``num_classes``: check that every label is in [0, num_classes) (recorded as ``checked_classes``).
    ``normalized``: check that the boxes are normalised to [0, 1], not in pixels (noisy
    annotations pass 1 a little: a coordinate beyond 2 is refused).
    Built on the boxes' device (the CPU in a DataLoader worker). The value checks run as one
    reduction read once by the host: one device sync for the batch, whichever are asked."""
    if len(boxes) == 0:
        raise ValueError("boxes is empty: need one [n_i, 4] tensor per image (n_i may be 0)")
    for i, b in enumerate(boxes):
        if not isinstance(b, Tensor) or b.ndim != 2 or b.shape[-1] != 4:
            raise ValueError(f"boxes[{i}] must be an [n, 4] tensor (xyxy), got {getattr(b, 'shape', type(b).__name__)}")
        check_boxes(b, f"boxes[{i}]", values=False)
    counts = tuple(b.shape[0] for b in boxes)
    B, dtype, device = len(boxes), boxes[0].dtype, boxes[0].device
    cat = torch.cat([b.to(dtype) for b in boxes])
    if labels is None:
        labels = [torch.zeros(n, dtype=torch.long, device=device) for n in counts]
    if len(labels) != B:
        raise ValueError(f"labels has {len(labels)} entries but boxes has {B} images")
    for i, (lab, n) in enumerate(zip(labels, counts)):
        if not isinstance(lab, Tensor) or lab.shape != (n,) or lab.is_floating_point():
            raise ValueError(f"labels[{i}] must be an integer tensor of shape ({n},), got {getattr(lab, 'shape', lab)}")
    M = max(counts) if pad_to is None else pad_to
    if M < max(counts):
        raise ValueError(f"pad_to={pad_to} is less than the largest box count in the batch ({max(counts)})")
    cat_labels = torch.cat([lab.long() for lab in labels])
    _check_values(boxes, counts, cat, cat_labels, validate=validate, num_classes=num_classes, normalized=normalized)
    counts_t = torch.tensor(counts, dtype=torch.long, device=device)
    batch_index = torch.repeat_interleave(torch.arange(B, device=device), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(cat.shape[0], device=device) - starts[batch_index]
    padded = torch.tensor(PAD_BOX, dtype=dtype, device=device).repeat(B, M, 1)
    padded_labels = torch.full((B, M), -1, dtype=torch.long, device=device)
    mask = torch.zeros(B, M, dtype=torch.bool, device=device)
    padded[batch_index, slot] = cat
    padded_labels[batch_index, slot] = cat_labels
    mask[batch_index, slot] = True
    return BoxTargets(counts, cat, cat_labels, batch_index, slot, padded, padded_labels, mask, num_classes)


_BAD_BOX, _PIXELS, _BAD_LABEL = 1, 2, 4  # bits of the one number _check_values reads


def _check_values(boxes, counts, cat: Tensor, cat_labels: Tensor, *, validate: bool, num_classes: int | None,
                  normalized: bool) -> None:
    """The value checks :func:`collate_boxes` was asked for, as one number on the boxes' device
    (a bit per failed check) read once; the error path then looks closer (more reads, once)."""
    flags = []
    if cat.numel() and validate:
        b = cat.detach()
        flags.append(((~torch.isfinite(b).all(-1) | (b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1])).any(), _BAD_BOX))
    if cat.numel() and normalized:
        flags.append(((cat.detach().abs() > 2).any(), _PIXELS))
    if cat_labels.numel() and num_classes is not None:
        flags.append((((cat_labels < 0) | (cat_labels >= num_classes)).any(), _BAD_LABEL))
    if not flags:
        return
    code = int(sum(flag.long() * bit for flag, bit in flags))  # the one host read
    if code & _BAD_BOX:
        bad = first_bad_box(cat)
        i = next(i for i in range(len(counts)) if bad < sum(counts[: i + 1]))
        check_boxes(boxes[i], f"boxes[{i}]")
    if code & _PIXELS:
        raise ValueError(f"boxes reach {cat.abs().max().item():g}, but they must be normalised to [0, 1]: divide x by "
                         f"the image width and y by its height")
    if code & _BAD_LABEL:
        raise ValueError(f"labels must be class ids in [0, {num_classes}), got values {cat_labels.unique().tolist()}")
