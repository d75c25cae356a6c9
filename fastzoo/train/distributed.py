"""Data-parallel training under ``torchrun``: process-group set-up from the environment
torchrun exports (gloo on CPU, nccl on CUDA), DDP or FSDP2 wrapping, the data sharding,
and full (unsharded) state dicts for checkpoints whatever the wrapping.

One process (no torchrun) is the world of size 1: every helper here then does nothing.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_distributed(device: str | None = None) -> World:
    """Join the process group torchrun described (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    ``device`` is "cpu", "cuda" or None (cuda when available). Each process on CUDA takes
    GPU ``LOCAL_RANK``; the backend is nccl on CUDA and gloo on CPU.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu")
    dev = torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else "gloo",
            timeout=datetime.timedelta(minutes=30),
            **({"device_id": dev} if kind == "cuda" else {}),
        )
    return World(rank, size, local_rank, dev)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, world: World, fsdp: bool = False) -> nn.Module:
    """DDP (default) or FSDP2 ``fully_shard`` over ``world``; the model itself if alone.

    FSDP2 shards each transformer block / stage (the children of the model's repeated
    ``ModuleList``), then the root, as torchtitan does; the returned module is the same
    object, now an ``FSDPModule``.
    """
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if not world.distributed:
            raise ValueError("--fsdp needs several processes: launch with torchrun --nproc_per_node N")
        for block in _repeated_blocks(model):
            fully_shard(block)
        return fully_shard(model)
    if not world.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def all_reduce_(t: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or ``op``) ``t`` in place over every process; a no-op when alone."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def all_gather_object(obj) -> list:
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_from_main(obj):
    """Process 0's ``obj`` on every process (a barrier that carries a value); ``obj`` when alone."""
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU (gathered from shards under FSDP); every rank calls this."""
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_model_state(model: nn.Module, state: dict) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
