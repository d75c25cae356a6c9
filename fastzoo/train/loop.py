"""The training loop all fastzoo scripts share.

A script describes its task (:class:`Task`: the model, the training items, how a list of
items becomes a batch, the loss, the evaluation) and calls :func:`train`. The loop owns
everything else: seeding, DDP/FSDP2 wrapping, the data order (a seeded permutation per
epoch, cut into global batches and split across processes, so the same ``--batch-size``
gives the same batches on 1 or N processes), bf16 autocast, gradient clipping, the LR
schedule, device-resident metrics printed every ``--log-interval`` steps, checkpoints,
``--resume``, NaN capture and ``--replay``.

Losses are returned as ``(sum, count)`` and normalised by the count summed over all
processes, so N processes compute the same mean as one process over the global batch,
even when processes hold different numbers of tokens or boxes.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from fastzoo import files
from fastzoo.errors import CheckpointError
from fastzoo.train import distributed as D
from fastzoo.train import nan_guard
from fastzoo.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from fastzoo.train.cli import UsageError, args_to_json
from fastzoo.train.metrics import RunningMeans
from fastzoo.train.progress import Progress, trim_log
from fastzoo.train.rng import get_rng_state, seed_everything, set_rng_state
from fastzoo.train.schedule import warmup_schedule

NAN_EXIT_CODE = 3


@dataclass
class Task:
    """What a script trains.

    ``loss(model, batch) -> (loss_sum, count)``: the summed loss over ``count`` items
    (images, predicted tokens, ...) of this process's batch, both device tensors.
    ``eval_step(model, batch) -> {name: (sum, count)}``; ``eval_finish`` derives more
    numbers from the means (e.g. perplexity). ``unit`` names what ``count`` counts, for
    the throughput display.
    """

    model: nn.Module
    train_items: Sequence
    collate: Callable[[list], object]
    loss: Callable[[nn.Module, object], tuple[torch.Tensor, torch.Tensor]]
    eval_items: Sequence | None = None
    eval_step: Callable[[nn.Module, object], dict] | None = None
    eval_finish: Callable[[dict], dict] = field(default=lambda m: m)
    unit: str = "samples"


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor) or callable(getattr(obj, "pin_memory", None)):  # tensors, BoxTargets
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def setup(args: argparse.Namespace) -> D.World:
    """Join the process group and seed; call before building the model (same init everywhere)."""
    world = D.init_distributed(args.device)
    if args.batch_size % world.size:
        raise UsageError(f"--batch-size {args.batch_size} is the global batch and must divide by the "
                         f"{world.size} processes")
    seed_everything(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return world


class Trainer:
    def __init__(self, args: argparse.Namespace, task: Task, world: D.World):
        self.args, self.task, self.world = args, task, world
        self.device = world.device
        self.raw = task.model.to(self.device)
        if args.sync_bn:
            self.raw = _sync_batchnorm(self.raw, world)
        self.model = D.wrap(self.raw, world, fsdp=args.fsdp)
        if args.compile:
            self.model = torch.compile(self.model)
        self.params = [p for p in self.raw.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # biases, norms, tokens: no weight decay (timm, HF)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr, betas=(0.9, 0.999),
        )
        self.local_batch = args.batch_size // world.size
        self.out = Path(args.output_dir)
        self.buffers = nan_guard.BufferSnapshot(self.raw) if args.nan_guard else None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.amp == "bf16")

    # -- one step ------------------------------------------------------------------------
    def forward_backward(self, batch, step: int, count_global: torch.Tensor | None = None, world_size=None):
        """Loss and gradients of ``batch`` (step ``step``, 1-based); returns loss, grad norm, sum, count."""
        with self.autocast():
            loss_sum, count = self.task.loss(self.model, batch)
        count = torch.as_tensor(count, device=self.device, dtype=torch.float32)
        if count_global is None:
            count_global = D.all_reduce_(count.clone())
        # DDP averages gradients over processes; scaling by the world size undoes that so the
        # gradient is that of sum(loss) / sum(count) over the global batch.
        loss = loss_sum.float() / count_global * (world_size or self.world.size)
        if self.args.debug_nan_at_step == step:
            loss = loss + float("inf")
        loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding this shard's part
            grad_norm = grad_norm.full_tensor()
        return loss, grad_norm, loss_sum.detach(), count, count_global

    # -- data ----------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        n = len(self.task.train_items) // self.args.batch_size
        if n == 0:
            raise UsageError(f"the training set has {len(self.task.train_items)} items, fewer than "
                             f"--batch-size {self.args.batch_size}")
        return n

    def train_loader(self, epoch: int, skip: int) -> DataLoader:
        sampler = DistributedSampler(self.task.train_items, num_replicas=self.world.size, rank=self.world.rank,
                                     shuffle=True, seed=self.args.seed, drop_last=True)
        sampler.set_epoch(epoch)
        order = list(sampler)[skip * self.local_batch : self.steps_per_epoch() * self.local_batch]
        return self._loader(self.task.train_items, order, epoch)

    def _loader(self, items, order, epoch: int) -> DataLoader:
        # An explicit generator keeps the loader from drawing its worker seed from the global
        # RNG, which would shift the dropout stream of a resumed run.
        return DataLoader(items, batch_size=self.local_batch, sampler=order, collate_fn=self.task.collate,
                          num_workers=self.args.workers, drop_last=False, pin_memory=self.device.type == "cuda",
                          generator=torch.Generator().manual_seed(self.args.seed + epoch))

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.task.eval_items is None or self.task.eval_step is None:
            return {}
        self.model.eval()
        means = RunningMeans(self.device)
        order = list(range(self.world.rank, len(self.task.eval_items), self.world.size))
        for batch in self._loader(self.task.eval_items, order, 0):
            with self.autocast():
                values = self.task.eval_step(self.model, to_device(batch, self.device))
            for name, (s, c) in values.items():
                means.update(name, s, c)
        self.model.train()
        result = {k: v for k, v in means.compute().items() if not k.endswith("_count")}
        return self.task.eval_finish(result)

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> int:
        args, world = self.args, self.world
        spe = self.steps_per_epoch()
        total = args.steps or args.epochs * spe
        state = TrainState()
        sched = warmup_schedule(self.optimizer, warmup_steps=args.warmup_steps, total_steps=total)
        self.scheduler = sched
        seed_everything(args.seed + world.rank)
        if args.resume is not None:
            state = load_checkpoint(args.resume, self.raw, self.optimizer, sched, world)
        if world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            for stale in self.out.glob(f"checkpoint-*[0-9]{files.TMP_SUFFIX}"):  # left by a run killed while saving
                files.recover_dir(stale.with_name(stale.name[: -len(files.TMP_SUFFIX)]))
            files.write_json(self.out / "args.json", args_to_json(args))
            if args.resume is None:
                (self.out / "log.jsonl").unlink(missing_ok=True)
            else:  # steps after the checkpoint are run again: their old records go
                trim_log(self.out / "log.jsonl", state.step)
        progress = Progress(total, state.step, self.out / "log.jsonl", self.task.unit, enabled=world.is_main)
        progress.message(f"training steps {state.step + 1} to {total} ({spe} an epoch of --batch-size {args.batch_size}), "
                         f"a line every {args.log_interval} (--log-interval)")
        means = RunningMeans(self.device)
        self.model.train()
        code = 0
        try:
            while state.step < total:
                for batch in self.train_loader(state.epoch, state.batch_in_epoch):
                    code = self._train_step(batch, state, means)
                    if code:
                        return code
                    if state.step % args.log_interval == 0 or state.step == total:
                        values = means.compute()
                        items = values.pop("loss_count", None)
                        values = {k: v for k, v in values.items() if not k.endswith("_count")}
                        progress.log(state.step, {"epoch": state.epoch_of_last_step, **values,
                                                  "lr": self.optimizer.param_groups[0]["lr"]}, items)
                    epoch_done = state.batch_in_epoch == spe
                    if epoch_done:
                        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                    if epoch_done or state.step == total:
                        self._evaluate_and_log(state, progress)
                    if (args.ckpt_interval and state.step % args.ckpt_interval == 0) or (
                            not args.ckpt_interval and epoch_done) or state.step == total:
                        self._save(state)
                    if state.step == total or epoch_done:
                        break
        finally:
            progress.close()
        if world.is_main:
            print(f"done: {state.step} steps; checkpoint in {self.out / f'checkpoint-{state.step}'}", flush=True)
        return code

    def _save(self, state: TrainState) -> None:
        """``checkpoint-<step>/`` (as Hugging Face's Trainer names them); only the newest
        ``--keep-checkpoints`` are kept."""
        save_checkpoint(self.out / f"checkpoint-{state.step}", self.raw, self.optimizer, self.scheduler, state, self.world)
        if self.world.is_main and self.args.keep_checkpoints > 0:
            old = sorted(self.out.glob("checkpoint-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
            for path in old[: -self.args.keep_checkpoints]:
                shutil.rmtree(path, ignore_errors=True)

    def _train_step(self, batch, state: TrainState, means: RunningMeans) -> int:
        args = self.args
        step = state.step + 1
        batch = to_device(batch, self.device)
        rng = get_rng_state() if args.nan_guard else None
        if args.nan_guard:  # the forward updates buffers (BatchNorm running stats): keep the pre-step values
            self.buffers.take()
        loss, grad_norm, loss_sum, count, count_global = self.forward_backward(batch, step)
        if args.nan_guard:
            bad = D.all_reduce_(nan_guard.nonfinite_flag(loss, grad_norm), op=torch.distributed.ReduceOp.MAX
                                if self.world.distributed else None)
            if bad.item():  # the one per-step host sync; --no-nan-guard removes it
                return self._capture(step, state, batch, rng, loss, count_global, self.buffers.as_dict())
        apply_update(self.optimizer, self.scheduler, self.params, args.clip_grad, grad_norm)
        means.update("loss", loss_sum, count)
        means.update("grad_norm", grad_norm)
        state.step, state.batch_in_epoch = step, state.batch_in_epoch + 1
        return 0

    def _evaluate_and_log(self, state: TrainState, progress: Progress) -> None:
        result = self.evaluate()
        if result:
            progress.message(f"eval @ step {state.step} (epoch {state.epoch_of_last_step}): "
                             + "  ".join(f"{k} {v:.4f}" for k, v in result.items()))
            progress.write_record({"step": state.step, "epoch": state.epoch_of_last_step, **{f"eval_{k}": v for k, v in result.items()}})

    def _capture(self, step, state, batch, rng, loss, count_global, buffers) -> int:
        world = self.world
        weights = D.full_model_state(self.raw)
        weights.update({k: v.cpu() for k, v in buffers.items() if k in weights})
        root = self.out / f"nan_step{step}"
        path = root / f"rank{world.rank}" if world.distributed else root
        meta = {"step": step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
                "loss": float(loss.detach()), "count_global": float(count_global), "world_size": world.size,
                "rank": world.rank, "args": args_to_json(self.args)}
        grads = nan_guard.grads_of(self.raw) if not world.distributed else None
        try:
            nan_guard.write_capture(path, model=self.raw, weights=weights, batch=batch, rng_state=rng, loss=loss,
                                    grads=grads, meta=meta)
            failed = None
        except OSError as e:
            failed = f"rank {world.rank}: {e}"
        # every process learns whether every write worked (in place of a bare barrier): one failed
        # write stops them all with the same error instead of leaving the others at the barrier
        failures = [f for f in D.all_gather_object(failed) if f]
        if failures:
            raise CheckpointError(f"{root}: could not write the NaN capture ({'; '.join(failures)}); stopped before "
                                  f"the update at step {step}")
        if world.is_main:
            script = Path(sys.argv[0]).as_posix()
            print(f"non-finite loss or gradient at step {step} (loss {float(loss.detach())}); stopped before the update.\n"
                  f"captured weights, batch and RNG states in {root}\n"
                  f"reproduce with: python {script} --replay {root}", file=sys.stderr, flush=True)
        return NAN_EXIT_CODE

    # -- replay --------------------------------------------------------------------------
    def replay(self) -> int:
        """Re-run the captured step; 0 when loss and gradients match bit for bit, 1 otherwise."""
        cap = nan_guard.read_capture(self.args.replay, self.raw)
        meta = cap["meta"]
        D.load_model_state(self.raw, cap["weights"])
        batch = to_device(cap["batch"], self.device)
        set_rng_state(cap["rng"])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        count_global = torch.tensor(meta["count_global"], device=self.device)
        with nan_guard.first_nonfinite_output(self.raw) as first_bad:
            loss, grad_norm, *_ = self.forward_backward(batch, meta["step"], count_global, meta["world_size"])
        grads = nan_guard.grads_of(self.raw)
        loss_same = nan_guard.bits_equal(loss.detach().float().cpu().reshape(()), cap["loss"])
        lines = [f"replayed step {meta['step']} from {nan_guard.resolve_capture_dir(self.args.replay)}",
                 f"  loss {float(loss.detach())} (captured {float(cap['loss'])}): {'bit-identical' if loss_same else 'DIFFERENT'}"]
        ok = loss_same
        if cap["grads"]:
            differ = [k for k in cap["grads"] if k not in grads or not nan_guard.bits_equal(grads[k], cap["grads"][k])]
            ok = ok and not differ and set(grads) == set(cap["grads"])
            worst = max((float((grads[k].double() - cap["grads"][k].double()).abs().nan_to_num(float("inf")).max())
                         for k in differ if k in grads and grads[k].shape == cap["grads"][k].shape), default=0.0)
            lines.append(f"  gradients: {len(cap['grads']) - len(differ)}/{len(cap['grads'])} tensors bit-identical"
                         + (f"; max abs difference {worst:.3g} in: {', '.join(differ[:8])}" if differ else ""))
        else:
            lines.append(f"  gradients: not compared (captured from {meta['world_size']} processes after their all-reduce)")
        nonfinite = [k for k, g in grads.items() if not torch.isfinite(g).all()]
        lines.append(f"  non-finite gradients: {', '.join(nonfinite[:8]) if nonfinite else 'none'}"
                     + (f" (+{len(nonfinite) - 8} more)" if len(nonfinite) > 8 else ""))
        lines.append(f"  first module with a non-finite output: {first_bad[0] if first_bad else 'none (the loss itself)'}")
        if self.args.debug_nan_at_step == meta["step"]:
            lines.append(f"  (--debug-nan-at-step {meta['step']} added +inf to this loss)")
        changed = sorted(k for k, v in args_to_json(self.args).items()
                         if k not in ("replay", "resume", "output_dir") and meta["args"].get(k) != v)
        lines.append("reproduced bit for bit" if ok else "NOT reproduced bit for bit" + (
            f" (arguments changed from the captured run: {', '.join(changed)})" if changed else
            ": the step depends on state that was not captured (a nondeterministic kernel, another process)"))
        print("\n".join(lines), flush=True)
        return 0 if ok else 1


def apply_update(optimizer, scheduler, params=(), clip_grad: float = 0.0, grad_norm=None) -> None:
    """The update after a backward, as every fastzoo loop makes it: clip to ``clip_grad`` (with the
    norm already measured), the optimizer's step, the schedule's, gradients cleared."""
    if clip_grad > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip_grad, grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def run_steps(task: Task, batches, optimizer, scheduler, *, autocast, before=None, after=None) -> None:
    """The loop for a caller that owns the order of the batches (the accuracy-parity runs give
    every arm the same ones), on one process: per batch of items, ``task.loss`` on the collated
    batch under ``autocast()``, divided by its count, backward, :func:`apply_update`;
    ``before(step)`` and ``after(step, loss)`` around each step (1-based)."""
    for step, items in enumerate(batches, 1):
        if before is not None:
            before(step)
        task.model.train()
        with autocast():
            loss_sum, count = task.loss(task.model, task.collate(items))
        loss = loss_sum / count
        loss.backward()
        apply_update(optimizer, scheduler)
        if after is not None:
            after(step, loss.detach())


def _sync_batchnorm(model: nn.Module, world: D.World) -> nn.Module:
    """``--sync-bn``: BatchNorm statistics over the global batch (torch.nn.SyncBatchNorm)."""
    trained = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if not trained:
        raise UsageError("--sync-bn: the model has no BatchNorm that trains its statistics (a detector's "
                         "backbone BN is frozen by default: add --model-kwargs frozen_bn=False)")
    if world.distributed and world.device.type != "cuda":
        # torch's SyncBatchNorm raises "expected input tensor to be on GPU" for CPU tensors under a process group
        raise UsageError("--sync-bn needs CUDA (torch's SyncBatchNorm has no CPU/gloo path); on CPU keep the "
                         "backbone BatchNorm frozen (frozen_bn=True, the detector's default), which makes every "
                         "process compute the same function without syncing")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)




def train(args: argparse.Namespace, task: Task, world: D.World) -> int:
    """Train (or ``--replay``) ``task``; returns the exit status (3 after a NaN capture)."""
    trainer = Trainer(args, task, world)
    if args.replay is not None:
        if world.distributed:
            raise UsageError("--replay runs in one process; launch it without torchrun")
        return trainer.replay()
    return trainer.fit()
