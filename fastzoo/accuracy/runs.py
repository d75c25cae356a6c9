"""Accuracy parity on real data: does a fast kernel change what a model learns?

One run file (``configs/accuracy_*.yaml``) names a model, its size (``overrides``), the data
(:mod:`fastzoo.accuracy.data`: digits, digits on a canvas, Python's help text), the optimiser,
the number of steps and the tolerance, and the *arms*: the original library's model (timm,
torchvision, Hugging Face) and fastzoo with each attention backend, input layout or GIoU
mode. Every arm starts from the same weights (the original's, loaded into fastzoo), sees the
same batches in the same order, and trains in fp32 with the same optimiser. Recorded per
arm: the training loss at every step, the held-out loss and metric (accuracy, or mAP@0.5
with torchmetrics) every ``eval_every`` steps.

Two comparisons with the first arm. *Free-running curves*: max absolute difference of each
curve over the run. *Same weights*: at step 0 and every ``eval_every`` steps the first arm's
parameters are copied into every arm, which computes the loss and the gradients of the next
batch; the largest loss difference and the worst parameter's gradient difference (max |diff|
over max |grad|) are recorded. A kernel that computes a different function fails the
same-weights check; one that rounds differently passes it, but its free-running curves can
still separate, because training amplifies a one-ulp difference step after step (the
detector's fused GIoU backward, see the README). Status: ``ok`` (both within tolerance),
``drifts`` (same weights within tolerance, free-running curves not; the step where they first
leave it is recorded), ``disagrees`` (the same-weights check fails, or, where a tolerance for
it is not set, the curves do). The arms agree when none disagrees.

    python benchmarks/accuracy_parity.py --config configs/accuracy_digits_vit.yaml
    python benchmarks/accuracy_parity.py --config configs/accuracy_digits_vit.yaml --steps 20 --set optim.lr=3e-4

Writes ``<name>.json`` and ``<name>.png`` to ``benchmarks/results/<device>/accuracy/`` (or ``--out``).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

import torch

from fastzoo.accuracy.config import Arm, Optim, RunConfig, Tolerance, model_config, peers, precision
from fastzoo.accuracy.report import AccuracyReport, ArmResult
from fastzoo.equivalence import LOW_FACTOR, compare_errors, curve_error, draw_, grad_error, loss_rounding
from fastzoo.errors import BackendUnavailableError, ConfigError
from fastzoo.machine import device_name, load_average, versions
from fastzoo.registry import get_entry
from fastzoo.tasks import resolve
from fastzoo.text import parse_dtype
from fastzoo.train.loop import run_steps
from fastzoo.train.schedule import warmup_schedule


def _original(cfg: RunConfig):
    """The original library's model of ``cfg.model``, built from its config and ``cfg.overrides``, as
    its users run it (the family's spec)."""
    original = get_entry(cfg.model).spec.original_as_users_run_it(model_config(cfg))
    if original is None:
        raise ConfigError(f"model {cfg.model}: its family has no original library model to start the arms from")
    return original


def parity_data(cfg: RunConfig, device):
    """The run's data (:mod:`fastzoo.accuracy.parity`), as its model's task names it for ``cfg.task``."""
    return resolve(get_entry(cfg.model).spec.task.parity[cfg.task])(cfg, device)


def initial_original(cfg: RunConfig, data) -> tuple:
    """``(model, pretrained)``: the original library's model every arm starts from, built with
    ``cfg.seed``, its backbone first trained by ``data`` where the run file says ``pretrain``
    (``pretrained``: what that did, ``{"accuracy", "seconds"}``; empty without it)."""
    torch.manual_seed(cfg.seed)
    original = _original(cfg)
    pretrained = {}
    if cfg.pretrain is not None:
        t0 = time.perf_counter()
        pretrained["accuracy"] = data.pretrain(original, cfg.pretrain, cfg.seed)
        pretrained["seconds"] = time.perf_counter() - t0
    return original, pretrained


def _models(cfg: RunConfig, device, original):
    """One model per arm, all with ``original``'s weights; an arm that cannot run here is returned
    as the error's message instead of a model."""
    import fastzoo

    out = []
    hf = _as_transformers(cfg, original) if any(a.hf for a in cfg.arms) else None
    for arm in cfg.arms:
        try:
            if arm.hf:
                m = copy.deepcopy(hf) if arm.original else fastzoo.create(pretrained=hf, attn=arm.attn or "sdpa")
            elif arm.original:
                m = copy.deepcopy(original)
            else:
                m = _fastzoo(cfg, arm, copy.deepcopy(original), device)
            if arm.nudge:
                _nudge(m, arm.nudge, cfg.seed)
            out.append(m.to(device))
        except BackendUnavailableError as e:
            out.append(str(e).split(". Available on this machine")[0])
    return out


def _as_transformers(cfg: RunConfig, original):
    """transformers' model of ``cfg.model`` (its ``save_pretrained`` form) on the original's weights."""
    import transformers

    import fastzoo

    m = fastzoo.create(cfg.model, pretrained=original)
    config, state = m.hf_pretrained()
    hf_config = transformers.AutoConfig.for_model(**config)
    hf_config._attn_implementation = "eager"
    hf = getattr(transformers, config["architectures"][0])(hf_config)
    hf.load_state_dict(state, strict=True)
    return hf


def _fastzoo(cfg: RunConfig, arm: Arm, original, device):
    """fastzoo's model of this arm on the original's weights. Its attention backend is checked
    for the dtype it computes in (the arm's autocast dtype: a bf16-only kernel serves a bf16 arm)."""
    import fastzoo

    m = fastzoo.create(cfg.model, attn="eager", pretrained=original, **({"giou_impl": arm.giou_impl} if arm.giou_impl else {}),
                       **arm.model_kwargs)
    amp = precision(arm)
    return m.set_attention(arm.attn or "sdpa", device=device, dtype=None if amp == "fp32" else parse_dtype(amp))


@torch.no_grad()
def _nudge(model, rel: float, seed: int) -> None:
    """Multiply every float parameter by 1 +- ``rel`` (random signs, seeded): a rounding-size change."""
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        if p.is_floating_point():
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.mul_(1 + rel * sign)


def _optimizer(model, o: Optim):
    return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))


def _scheduler(opt, o: Optim, steps: int):
    """The scripts' schedule (:mod:`fastzoo.train.schedule`): warm-up, then ``o.schedule``."""
    return warmup_schedule(opt, warmup_steps=o.warmup_steps, total_steps=steps, decay=o.schedule)


def _batches(n: int, batch_size: int, steps: int, seed: int):
    """The same index batches for every arm: epochs of a seeded permutation."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(math.ceil(steps * batch_size / n) + 1)])
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


def run(cfg: RunConfig, *, device="cpu", progress: bool = True) -> AccuracyReport:
    from tqdm.auto import tqdm

    device = torch.device(device)
    load = [load_average()]
    data = parity_data(cfg, device)
    batches = _batches(data.n, cfg.optim.batch_size, cfg.steps, cfg.seed)
    original, pretrained = initial_original(cfg, data)
    models = _models(cfg, device, original)
    results, snapshots = [], None
    with tqdm(total=len(cfg.arms) * cfg.steps, desc=cfg.name, disable=not progress, leave=False, dynamic_ncols=True) as bar:
        for arm, model in zip(cfg.arms, models):
            bar.set_postfix_str(arm.name)
            r = ArmResult(arm.name)
            results.append(r)
            if isinstance(model, str):
                r.status, r.note = "unavailable", model
                bar.update(cfg.steps)
                continue
            t0 = time.perf_counter()
            first = snapshots is None  # the first arm that runs keeps its parameters for the same-weights check
            snapshots = [] if first else snapshots
            try:
                _train(cfg, data, arm, model, batches, r, bar, snapshots if first else None)
            except BackendUnavailableError as e:  # e.g. no backward for this kernel on this device
                r.status, r.note = "unavailable", str(e).split(". Available on this machine")[0]
                r.train_loss, r.eval_steps, r.eval_loss, r.eval_metric = [], [], [], []
                snapshots = None if first else snapshots
            r.seconds = time.perf_counter() - t0
    _same_weights(cfg, data, batches, models, results, snapshots or [])
    _compare(cfg, results)
    return AccuracyReport(_as_dict(cfg), data.metric, device_name(device), versions(), results,
                          threads=torch.get_num_threads(), load=load + [load_average()], pretrained=pretrained)


def _train(cfg, data, arm, model, batches, r: ArmResult, bar, snapshots: list | None = None):
    """Train ``model`` on ``batches`` with the loop every fastzoo training shares
    (:func:`fastzoo.train.loop.run_steps`); with a ``snapshots`` list (the first arm), append (step
    index, a copy of the model) before step 1 and every ``eval_every`` steps."""
    opt = _optimizer(model, cfg.optim)
    sched = _scheduler(opt, cfg.optim, len(batches))

    def before(step: int) -> None:
        if snapshots is not None and (step - 1) % cfg.eval_every == 0:
            snapshots.append((step - 1, copy.deepcopy(model)))

    def after(step: int, loss: torch.Tensor) -> None:
        r.train_loss.append(loss.item())
        if step % cfg.eval_every == 0 or step == len(batches):
            model.eval()
            with _autocast(arm, data.device):
                el, em = data.evaluate(arm, model)
            r.eval_steps.append(step)
            r.eval_loss.append(el)
            r.eval_metric.append(em)
        bar.update(1)

    run_steps(data.task(arm, model), batches, opt, sched, autocast=lambda: _autocast(arm, data.device),
              before=before, after=after)


def _autocast(arm: Arm, device):
    """The arm's autocast (``amp``), or a no-op context in fp32."""
    amp = precision(arm)
    return torch.autocast(torch.device(device).type, dtype=parse_dtype(amp), enabled=amp != "fp32")


def _load_weights(cfg: RunConfig, arm: Arm, ref_arm: Arm, snapshot, trained):
    """A copy of this arm's model holding the first arm's parameters ``snapshot`` (a model of the
    first arm's kind), built the way the arm was built at step 0; None if it cannot be."""
    if arm.hf:  # the original -> transformers' form (-> fastzoo built from it), as at step 0
        if not ref_arm.original:
            return None
        import fastzoo

        hf = _as_transformers(cfg, copy.deepcopy(snapshot))
        m = hf if arm.original else fastzoo.create(pretrained=hf, attn=arm.attn or "sdpa")
        return m.to(next(trained.parameters()).device)
    if arm.original:
        return copy.deepcopy(snapshot) if ref_arm.original else None
    if ref_arm.original:  # the original library's model -> fastzoo, the same conversion as at step 0
        device = next(trained.parameters()).device
        return _fastzoo(cfg, arm, copy.deepcopy(snapshot), device).to(device)
    m = copy.deepcopy(trained)
    m.load_state_dict(snapshot.state_dict())
    return m


def _loss_and_grads(task, arm, model, idx):
    model.train()
    model.zero_grad(set_to_none=True)
    with _autocast(arm, task.device):
        loss = task.loss(arm, model, idx)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_weights(cfg, task, batches, models, results, snapshots) -> None:
    """At each snapshot of the first arm (step k), every arm's loss and gradients on batch k + 1
    from those parameters, against the first arm's own; first on a full random state drawn into the
    first snapshot (``equivalence.draw_``: nonzero biases, norm gains, statistics, which a few
    training steps from a library's init barely move)."""
    ran = [(a, m, r) for a, m, r in zip(cfg.arms, models, results) if r.status == "ok" and not isinstance(m, str)]
    if len(ran) < 2 or not snapshots:
        return
    snapshots = [(snapshots[0][0], draw_(copy.deepcopy(snapshots[0][1]), seed=cfg.seed)), *snapshots]
    (ref_arm, ref_model, _), others = ran[0], ran[1:]
    for step, snap in snapshots:
        idx = batches[step]
        ref_loss, ref_grads = _loss_and_grads(task, ref_arm, _load_weights(cfg, ref_arm, ref_arm, snap, ref_model), idx)
        for arm, model, r in others:
            m = _load_weights(cfg, arm, ref_arm, snap, model)
            if m is None:
                continue
            loss, grads = _loss_and_grads(task, arm, m, idx)
            ref_as_arm = _as_arm(cfg, arm, ref_arm, snap, ref_grads, model)  # the original's layout -> this arm's
            sw = r.same_weights
            for key in ("steps", "loss", "loss_diff", "grad_err"):
                sw.setdefault(key, [])
            sw["steps"].append(step)
            sw["loss"].append(loss)
            sw["loss_diff"].append(abs(loss - ref_loss))
            sw["grad_err"].append(grad_error({n: grads.get(n, torch.zeros_like(g)) for n, g in ref_as_arm.items()},
                                             ref_as_arm))


def _as_arm(cfg, arm, ref_arm, snapshot, ref_grads: dict, trained) -> dict:
    """The first arm's gradients in this arm's parameter layout: put into a copy of the first
    arm's model as its parameters and converted exactly as its weights are (e.g. Hugging Face
    GPT-2's ``Conv1D`` [in, out] -> fastzoo's ``Linear`` [out, in])."""
    g = copy.deepcopy(snapshot)
    with torch.no_grad():
        for n, p in g.named_parameters():
            p.copy_(ref_grads[n] if n in ref_grads else torch.zeros_like(p))
    return {n: p.detach() for n, p in _load_weights(cfg, arm, ref_arm, g, trained).named_parameters()}


def _compare(cfg: RunConfig, results: list[ArmResult]) -> None:
    """Each arm against the first, by fastzoo.equivalence's rule: an fp32 arm within the file's
    tolerance; an arm in low precision within LOW_FACTOR times its precision's peer's difference
    plus that tolerance. The peers and rounding controls are reported, not judged."""
    ran = [(a, r) for a, r in zip(cfg.arms, results) if r.status == "ok"]
    if not ran:
        return
    ref, tol = ran[0][1], cfg.tolerance
    peer_of = {amp: a.name for amp, a in peers(cfg.arms).items()}
    by_name = {r.name: r for _, r in ran}
    for arm, r in ran[1:]:
        r.diff = {key: curve_error(getattr(r, key), getattr(ref, key)) for key in ("train_loss", "eval_loss", "eval_metric")}
        if r.same_weights:
            r.diff["same_weights_loss"] = max(r.same_weights["loss_diff"])
            r.diff["same_weights_grad"] = max(r.same_weights["grad_err"])
        amp = precision(arm)
        if arm.nudge:
            r.status, r.note = "control", f"initial weights x (1 +- {arm.nudge:g}): the drift rounding alone causes"
        elif amp != "fp32" and peer_of[amp] == arm.name:
            r.status = "peer"
            r.note = (f"{ran[0][0].name} in {amp}: what {amp} alone changes; the other {amp} arms may differ "
                      f"{LOW_FACTOR:g}x as much, plus the fp32 tolerance")
        elif amp != "fp32" and by_name.get(peer_of[amp], ArmResult("")).status != "peer":
            r.status, r.note = "unjudged", f"no {amp} peer ran: nothing to bound its {amp} difference by"
        else:
            _judge(r, tol, by_name[peer_of[amp]] if amp != "fp32" else None, amp)
        r.first_over = next((i for i, (a, b) in enumerate(zip(r.train_loss, ref.train_loss), 1)
                             if not abs(a - b) <= r.bound.get("train_loss", tol.train_loss)), None)
        if r.status == "drifts":
            r.note += f" (first at step {r.first_over})"


def _judge(r: ArmResult, tol: Tolerance, peer: ArmResult | None, amp: str = "fp32") -> None:
    """``ok``, ``drifts`` or ``disagrees`` (module docstring) from the arm's differences and bounds; in
    low precision the same-weights loss may also differ by the loss's own rounding (``compare_loss``'s rule)."""
    limits = {key: limit for key in r.diff if (limit := getattr(tol, key)) is not None}
    if peer is not None and "same_weights_loss" in limits:
        limits["same_weights_loss"] += loss_rounding(max(map(abs, r.same_weights["loss"])), parse_dtype(amp))
    comps = {key: compare_errors(key, r.diff[key], limit, None if peer is None else peer.diff.get(key))
             for key, limit in limits.items()}
    r.bound = {key: c.bound for key, c in comps.items()}
    over = {k: f"{k} {c.err:.2g} > {c.bound:.2g}" for k, c in comps.items() if not c.passed}
    curves = [v for k, v in over.items() if not k.startswith("same_weights")]
    same = [v for k, v in over.items() if k.startswith("same_weights")]
    if same or (curves and not any(k.startswith("same_weights") for k in comps)):
        r.status, r.note = "disagrees", "; ".join(same + curves)
    elif curves:
        r.status = "drifts"
        r.note = (f"same weights: loss within {r.diff['same_weights_loss']:.1e}, grads within "
                  f"{r.diff['same_weights_grad']:.1e}; free-running: {'; '.join(curves)}")
    elif peer is not None:
        r.note = f"within {LOW_FACTOR:g}x {peer.name}'s difference from the fp32 reference, plus the fp32 tolerance"


def _as_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)
