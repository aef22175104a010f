"""How the ranks hold the drafter (`training.sharding`): DDP replicas or FSDP2 shards, gradient-sync control
for accumulation, and the whole weights gathered back onto rank 0 for evaluation and export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.training.distributed import DistInfo


def wrap(
    model: PEagleDraftModel, sharding: str, info: DistInfo, device: torch.device, precision: str = "fp32"
) -> torch.nn.Module:
    """The module training runs forward/backward through: `model` itself on one rank, its DDP wrapper, or
    `model` sharded in place by FSDP2 (each decoder layer, then the root with the embeddings, `fc`, norm
    and lm_head). Build the optimizer after this: under FSDP its parameters are the shards."""
    if not info.enabled:
        return model
    if sharding == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh(device.type, (info.world_size,))
    # CUDA: bf16 compute with fp32 gradient reduction, as autocast does for DDP. A CPU keeps fp32 shards
    # and leaves bf16 to autocast, so that FSDP steps equal single-rank and DDP ones there.
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16" and device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextlib.contextmanager
def grad_sync(module: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Within it, backward reduces gradients across ranks only when `sync` (the step's last micro-batch);
    earlier micro-batches accumulate locally."""
    if isinstance(module, DistributedDataParallel) and not sync:
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole drafter's weights on CPU on rank 0 ({} elsewhere under FSDP). A collective under FSDP:
    every rank calls it."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_model(model: PEagleDraftModel, info: DistInfo) -> PEagleDraftModel | None:
    """The drafter with all its weights, for evaluation and export: `model` itself unless FSDP shards it,
    else a plain copy gathered onto rank 0 (None on other ranks). A collective under FSDP."""
    if not isinstance(model, FSDPModule):
        return model
    weights = full_state_dict(model)
    if not info.is_main:
        return None
    device = model.d2t.device  # buffers stay whole (and on the rank's device) under FSDP
    plain = PEagleDraftModel(model.config)
    plain.load_state_dict(weights)
    for name, buf in model.named_buffers():  # non-persistent ones (vocab map, rotary tables) too
        plain.get_buffer(name).copy_(buf)
    for name, p in model.named_parameters():
        plain.get_parameter(name).requires_grad_(p.requires_grad)
    return plain.to(device)
