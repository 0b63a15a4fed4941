"""Process group, FSDP2 sharding and full-state gathering: the only distributed code of the trainer.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to each decoder layer, bottom-up, then
to the root (torchtune's recipe), so each layer's weights are all-gathered just for its own
forward and backward. gloo on CPU, NCCL on GPU; on GPU parameters compute in bf16 with fp32
master weights and fp32 gradient reduction (`MixedPrecisionPolicy`). The CPU path is the same
FSDP2 code under gloo, in fp32 (bf16 is slower than fp32 on CPUs without native bf16 and AdamW
updates at small lr round away). One process on CPU is not sharded (a one-rank mesh has
nothing to shard; the step math is the same, checked by the 2-rank test against it).

State dicts leave FSDP as full tensors on CPU (`get_model_state_dict(full_state_dict=True,
cpu_offload=True)`): all ranks take part, rank 0 gets the tensors and writes them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)


def init() -> tuple[int, int, torch.device]:
    """Join the torchrun process group; returns (rank, world size, device)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (peft-wrapped or not): the first
    `ModuleList` named `layers` (`model.layers` in Llama, Qwen, Mistral, Gemma...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(module)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def shard_model(model: nn.Module, world: int, device: torch.device, mixed_precision: bool) -> nn.Module:
    """FSDP2 over the decoder layers, then the root. A single CPU process stays unsharded."""
    if world == 1 and device.type == "cpu":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision and device.type == "cuda" else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full CPU tensors on rank 0 (empty elsewhere); every rank must call it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=opts)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, full tensors on rank 0; every rank calls it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full (name-keyed) optimizer state on every rank, sharding it as the model is.
    The LR scheduler's bookkeeping (`initial_lr`) is left to the scheduler's own state."""
    for group in state.get("param_groups", []):
        group.pop("initial_lr", None)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (pickled; for small things such as token id lists)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
