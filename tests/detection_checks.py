"""What the detector tests share (DETR, Deformable DETR, RT-DETR, D-FINE, RF-DETR and their set losses): random
boxes in transformers' label convention, labels in another dtype, the gradients a backward left, the failed
comparisons of a list (each named with its error, bound and worst parameter), and the hybrid detectors' loss path
against transformers'."""
import torch

from fastzoo.equivalence.rule import compare_grads, compare_outputs


def boxes_labels(counts, num_labels: int, g: torch.Generator) -> list[dict]:
    """Per image, ``counts[i]`` boxes (cxcywh: centres in [0.2, 0.8], sides in [0.05, 0.35], inside the image) and
    their class ids below ``num_labels``, drawn from ``g``."""
    out = []
    for n in counts:
        c, wh = torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.05
        out.append({"class_labels": torch.randint(0, num_labels, (n,), generator=g), "boxes": torch.cat([c, wh], 1)})
    return out


def labels_in(labels: list[dict], dtype: torch.dtype) -> list[dict]:
    """``labels`` with their boxes in ``dtype`` (for a run of the original in fp64)."""
    return [{"class_labels": t["class_labels"], "boxes": t["boxes"].to(dtype)} for t in labels]


def grads(model) -> dict:
    """The gradients a backward left on ``model``'s parameters, by name."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def backward(hf, ours, loss_hf, loss_ours) -> tuple[dict, dict]:
    """Both models' gradients of their losses (each model's earlier gradients cleared first)."""
    hf.zero_grad()
    ours.zero_grad()
    loss_hf.backward()
    loss_ours.backward()
    return grads(hf), grads(ours)


def failures(checks) -> list:
    """The comparisons of ``checks`` that failed: name, error, bound and the worst parameter (gradients)."""
    return [(c.name, c.err, c.bound, c.worst) for c in checks if not c.passed]


def compare_loss_path(hf, ours, x, labels, *, seed: int, min_grads: int, own_rounding):
    """The hybrid detectors' forward with ``labels`` (denoising queries drawn after ``seed`` in train mode):
    logits, boxes, the loss and every loss_dict term in transformers' order, every auxiliary output (the fp32
    rule: 1e-4 absolute, or 8 ulps of their scale); every gradient of the loss (1e-4 of the scale, or 3x the
    original's own fp32 rounding where larger: ``own_rounding(run, hf, x, labels)`` gives ``compare_grads``'
    keyword for it, ``exact=`` from an fp64 run or ``kernels=`` from a run on its users' kernel). Returns
    fastzoo's output."""

    def run(m, x, labels):
        torch.manual_seed(seed)
        return m(pixel_values=x, labels=labels)

    o1, o2 = run(hf, x, labels), run(ours, x, labels)
    checks = [compare_outputs(k, getattr(o2, k), getattr(o1, k)) for k in ("logits", "pred_boxes", "loss")]
    assert list(o2.loss_dict) == list(o1.loss_dict)
    checks += [compare_outputs(k, o2.loss_dict[k], o1.loss_dict[k]) for k in o1.loss_dict]
    for i, (a, b) in enumerate(zip(o1.auxiliary_outputs or [], o2.auxiliary_outputs or [], strict=True)):
        assert set(a) == set(b)
        checks += [compare_outputs(f"aux {i} {k}", b[k], a[k]) for k in a]
    g1, g2 = backward(hf, ours, o1.loss, o2.loss)
    assert len(g1) > min_grads and set(g1) == set(g2)
    checks.append(compare_grads("grads", g2, g1, **own_rounding(run, hf, x, labels)))
    assert not failures(checks), failures(checks)
    return o2


def compare_eval(hf, ours, x, outputs: tuple[str, ...]) -> None:
    """The hybrid detectors in eval mode without labels: each of ``outputs`` and every encoder map by the fp32
    rule (1e-4 absolute, or 8 ulps of their scale); both models left in train mode."""
    with torch.no_grad():
        o1, o2 = hf.eval()(pixel_values=x), ours.eval()(pixel_values=x)
    checks = [compare_outputs(k, getattr(o2, k), getattr(o1, k)) for k in outputs]
    checks += [compare_outputs(f"encoder map {i}", b, a)
               for i, (a, b) in enumerate(zip(o1.encoder_last_hidden_state, o2.encoder_last_hidden_state, strict=True))]
    assert not failures(checks), failures(checks)
    hf.train()
    ours.train()


def read_back(hf, ours, path, hf_class, **inputs) -> tuple:
    """``ours`` written by ``save_pretrained`` into ``path``, read by transformers' ``hf_class`` and back by fastzoo:
    both in eval mode (as transformers' ``from_pretrained`` gives a model), with ``hf``'s logits on ``inputs``
    (the fp32 rule, 1e-4; ``hf`` is left in eval mode)."""
    import fastzoo

    ours.save_pretrained(path)
    back = hf_class.from_pretrained(path)
    again = fastzoo.create(pretrained=str(path))
    with torch.no_grad():
        ref = hf.eval()(**inputs).logits
        for m in (back, again):
            assert not m.training
            assert (m(**inputs).logits - ref).abs().max() <= 1e-4
    return back, again
