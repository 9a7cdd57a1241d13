"""Training under torchrun: the process group, each rank's device, decisions every rank takes together, the
gradient sum of plain data parallel, and FSDP2 sharding of the draft (--fsdp).

Each rank's loss is its share of the global loss (normalised by the global count of loss positions), so the ranks'
gradients are summed, never averaged: every rank then steps with exactly the single-process gradient of the global
batch, with or without FSDP."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from eyas.train.dflash import BlockObjective
from eyas.train.ttt import TTTLoss


def setup_distributed(device: str = "cpu") -> tuple[int, int]:
    """(rank, world size) under torchrun, else (0, 1). The backend follows where the tensors live: nccl for CUDA
    tensors, gloo for CPU ones (nccl cannot reduce CPU tensors, even on a machine with a GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[tuple[int, int]]:
    """setup_distributed's (rank, world size) for one run, and the process group it created torn down after it: a
    gloo group still alive when the interpreter exits can abort the process ("terminate called without an active
    exception") after a run that succeeded."""
    created = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    try:
        yield setup_distributed(device)
    except BaseException:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        raise
    if created and dist.is_initialized():
        # the ranks leave together: a group torn down while a peer still talks to it can abort that peer (a rank of
        # a run that succeeded died of SIGABRT once on a loaded machine)
        dist.barrier()
        dist.destroy_process_group()


def train_device(device: str) -> torch.device:
    """This process's device: under torchrun each rank takes its own GPU (LOCAL_RANK)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def agreed(world: int, *flags: bool) -> list[bool]:
    """The flags OR-ed over the ranks, so every rank saves and stops at the same step."""
    if world == 1:
        return list(flags)
    t = torch.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def all_reduce_sum(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """`tensor` summed over the ranks, in place (unchanged in a single process)."""
    if world > 1:
        dist.all_reduce(tensor)
    return tensor


def sum_gradients(params: Iterable[torch.Tensor], world: int) -> None:
    """Plain data parallel: each parameter's gradient summed over the ranks (under FSDP the backward pass has
    already reduce-scattered them, summed, into each rank's shard)."""
    if world == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)


def shard_draft(loss_fn: TTTLoss | BlockObjective, world: int) -> None:
    """FSDP2 over the draft's own weights, in place. fc, the MLPs and an EAGLE-3 draft's lm_head (the large
    matrices, each called through its forward) are units of their own, gathered around each call only; the rest of
    the layers (attention, norms) is gathered by the root unit for the whole step. The embedding (and a DFlash draft's
    lm_head) is the target's own module, run by the target's forward too: it stays whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    draft = loss_fn.draft
    mesh = init_device_mesh(draft.fc.weight.device.type, (world,))
    units = [draft.fc, *(layer.mlp for layer in draft.layers)]
    if "lm_head.weight" not in draft.shared_weights:
        units.append(draft.lm_head)
    for module in units:
        fully_shard(module, mesh=mesh)
    shared = {p for name, p in draft.named_parameters() if name in draft.shared_weights}
    fully_shard(loss_fn, mesh=mesh, ignored_params=shared)
    for module in [*units, loss_fn]:
        module.set_gradient_divide_factor(1.0)  # summed, as the module docstring says
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
