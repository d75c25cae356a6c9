"""The data an accuracy-parity run trains on, one class per run file ``task:`` (a task's
``parity`` names them): each holds its train and held-out sets, gives the shared training loop
(:mod:`fastzoo.train.loop`) a :class:`~fastzoo.train.loop.Task` for an arm's model, and evaluates
an arm (held-out loss and metric)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastzoo.accuracy.config import Arm, Pretrain, RunConfig, model_config
from fastzoo.errors import ConfigError
from fastzoo.losses.lm import IGNORE_INDEX, next_token_targets
from fastzoo.train.loop import Task


class ParityData:
    """The protocol: ``n`` training items, ``metric`` (the held-out metric's name),
    ``loss(arm, model, idx)`` (the mean loss of the items ``idx`` in the arm's layout) and
    ``evaluate(arm, model) -> (held-out loss, metric)``."""

    metric = "accuracy"
    n: int

    def loss(self, arm: Arm, model, idx) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, arm: Arm, model) -> tuple[float, float]:
        raise NotImplementedError

    def task(self, arm: Arm, model) -> Task:
        """What the shared loop trains for this arm: batches are index tensors, the loss their mean
        (count 1: the loop's sum / count is then the mean itself, bit for bit)."""
        return Task(model, range(self.n), collate=torch.as_tensor, loss=lambda m, idx: (self.loss(arm, m, idx), 1))


class Digits(ParityData):
    """Classification of the upsampled digits: cross-entropy, held-out accuracy."""

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import digits

        self.train, self.test = digits(cfg.data.img_size, test_fraction=cfg.data.test_fraction, seed=cfg.seed)
        self.n, self.device = len(self.train.y), device

    @staticmethod
    def _logits(arm, model, x):
        return model(pixel_values=x).logits if arm.hf else model(x)  # transformers' call for its arms

    def loss(self, arm, model, idx):
        logits = self._logits(arm, model, self.train.x[idx].to(self.device))
        return F.cross_entropy(logits.float(), self.train.y[idx].to(self.device))

    @torch.no_grad()
    def evaluate(self, arm, model):
        logits = torch.cat([self._logits(arm, model, x.to(self.device)).float().cpu() for x in self.test.x.split(256)])
        return F.cross_entropy(logits, self.test.y).item(), (logits.argmax(-1) == self.test.y).float().mean().item()


class Quadrants(Digits):
    """Which quadrant of a noisy image is brighter (synthetic, ``data.n_train`` / ``n_test`` images)."""

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import quadrants

        g = torch.Generator().manual_seed(cfg.seed)
        self.train, self.test = quadrants(cfg.data.n_train, g, cfg.data.img_size), quadrants(cfg.data.n_test, g, cfg.data.img_size)
        self.n, self.device = cfg.data.n_train, device


class Text(ParityData):
    """Next-token prediction on Python's help text; held-out metric: next-token accuracy."""

    metric = "next-token accuracy"

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import bpe_tokenizer, pydoc_documents

        docs = pydoc_documents()
        tok = bpe_tokenizer(docs, cfg.data.vocab_size)
        if len(tok) > model_config(cfg)["vocab_size"]:
            raise ConfigError(f"overrides.vocab_size must be >= the tokenizer's {len(tok)} ids")
        seqs = []
        for d in docs:
            ids = torch.tensor(tok.encode(d) + [tok.eos_token_id])
            seqs += [p for p in ids.split(cfg.data.max_len) if len(p) > 1]
        perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        n_val = int(len(seqs) * cfg.data.val_fraction)
        self.val = [seqs[i] for i in perm[:n_val]]
        self.train = [seqs[i] for i in perm[n_val:]]
        self.n, self.device, self.tokens = len(self.train), device, sum(map(len, seqs))
        self.vocab = len(tok)

    def _forward(self, arm, model, seqs):
        """(mean next-token loss, #correct, #targets) of one batch in the arm's layout."""
        from fastzoo.data import nested, pack, pad_to_longest
        from fastzoo.losses import causal_lm_loss

        layout = arm.layout or "padded"
        if arm.original or layout == "padded":
            b = pad_to_longest(seqs).to(self.device)
            if arm.original:  # Hugging Face's own call and loss, as its users write it
                out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
                return out.loss, out.logits, b.labels
            logits = _logits(model(**b.model_inputs()))
            return causal_lm_loss(logits, b.labels), logits, b.labels
        if layout == "packed":
            b = pack(seqs).to(self.device)
            logits = _logits(model(**b.model_inputs()))
            return causal_lm_loss(logits, b.labels, cu_seqlens=b.cu_seqlens), logits, b.labels
        ids = nested(seqs).to(self.device)
        logits = _logits(model(ids))
        labels = ids.clone()
        return causal_lm_loss(logits, labels), torch.cat(logits.unbind())[None], _first_ignored(seqs).to(self.device)

    def loss(self, arm, model, idx):
        return self._forward(arm, model, [self.train[i] for i in idx.tolist()])[0]

    @torch.no_grad()
    def evaluate(self, arm, model):
        total = correct = count = 0.0
        for i in range(0, len(self.val), 32):
            loss, logits, labels = self._forward(arm, model, self.val[i:i + 32])
            target = next_token_targets(labels)
            keep = target != IGNORE_INDEX
            n = keep.sum().item()
            total += loss.item() * n
            correct += ((logits.argmax(-1) == target) & keep).sum().item()
            count += n
        return total / count, correct / count


def _first_ignored(seqs):
    """Packed labels of ``seqs`` (IGNORE_INDEX on each sequence's first token): the nested arm's targets."""
    from fastzoo.data import pack

    return pack(seqs).labels


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


class Canvas(ParityData):
    """Digits on a canvas, trained through transformers' DETR call (``pixel_values=``, ``labels=`` with
    ``class_labels`` and cxcywh ``boxes``, ``.loss``) for every arm, the original's included; held-out
    loss and mAP@0.5 (torchmetrics) of the top-scoring class of every query, as
    ``post_process_object_detection`` reads them."""

    metric = "mAP@0.5"

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import digits_canvas

        d = cfg.data
        self.train, self.test = digits_canvas(d.n_train, d.n_test, canvas=d.img_size, max_digits=d.max_digits,
                                              digit_px=tuple(d.digit_px), test_fraction=d.test_fraction, seed=cfg.seed)
        self.n, self.device = len(self.train.boxes), device
        self.data = d

    def pretrain(self, original, p: Pretrain, seed: int) -> float:
        """Train ``original``'s backbone (transformers' ``model.backbone.model``) to classify single
        training digits (:mod:`fastzoo.accuracy.pretrain`); the held-out digits stay unseen (the same
        split as the canvases'). Returns the accuracy on its last batch."""
        from fastzoo.accuracy.data import digits_canvas
        from fastzoo.accuracy.pretrain import pretrain_backbone

        d = self.data
        if p.img_size < d.digit_px[1]:
            raise ConfigError(f"pretrain.img_size {p.img_size} is smaller than the largest digit (data.digit_px {d.digit_px})")
        single, _ = digits_canvas(p.n_images, 1, canvas=p.img_size, max_digits=1, digit_px=tuple(d.digit_px),
                                  test_fraction=d.test_fraction, seed=seed)
        labels = torch.cat(single.labels)
        return pretrain_backbone(original.model.backbone.model, single.images, labels, num_classes=10, steps=p.steps,
                                 lr=p.lr, batch_size=p.batch_size, seed=seed)

    def _out(self, model, images, boxes, classes):
        labels = [{"class_labels": c.to(self.device), "boxes": _cxcywh(b).to(self.device)} for b, c in zip(boxes, classes)]
        return model(pixel_values=images.to(self.device), labels=labels)

    def loss(self, arm, model, idx):
        idx = idx.tolist()
        return self._out(model, self.train.images[idx], [self.train.boxes[i] for i in idx],
                         [self.train.labels[i] for i in idx]).loss

    @torch.no_grad()
    def evaluate(self, arm, model):
        from torchmetrics.detection import MeanAveragePrecision

        mean_ap = MeanAveragePrecision(iou_thresholds=[0.5], box_format="cxcywh")
        total, n = 0.0, 0
        for i in range(0, len(self.test.boxes), 64):
            sl = slice(i, i + 64)
            out = self._out(model, self.test.images[sl], self.test.boxes[sl], self.test.labels[sl])
            total += out.loss.item() * len(self.test.boxes[sl])
            n += len(self.test.boxes[sl])
            scores, classes = out.logits.float().softmax(-1)[..., :-1].max(-1)  # the last class is "no object"
            preds = [{"boxes": b.float().cpu(), "scores": s.cpu(), "labels": c.cpu()}
                     for b, s, c in zip(out.pred_boxes, scores, classes)]
            target = [{"boxes": _cxcywh(b), "labels": c} for b, c in zip(self.test.boxes[sl], self.test.labels[sl])]
            mean_ap.update(preds, target)
        return total / n, float(mean_ap.compute()["map_50"])


def _cxcywh(xyxy: torch.Tensor) -> torch.Tensor:
    return torch.cat([(xyxy[..., :2] + xyxy[..., 2:]) / 2, xyxy[..., 2:] - xyxy[..., :2]], -1)
