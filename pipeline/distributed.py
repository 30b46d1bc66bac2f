"""Data x context parallel training on torch.distributed, driven by Lightning's DDP strategy.

The ``world = devices * num_nodes`` ranks form a ``[data, context]`` device mesh: the ``P`` ranks
of one context group share each sequence (:mod:`megabase.pipeline.context_parallel`), the
``world / P`` data groups take disjoint parts of every global batch. Each rank's objective is its
share of the single-process loss of the whole global batch (LM loss summed over its targets over
the global count of scored targets, auxiliary losses over the data-parallel size), so the sum of
the per-rank gradients is exactly the single-process gradient. DDP averages over the world, hence
the ``world`` factor in :func:`objective`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .context_parallel import ContextParallel, apply_context_parallel, summed
from .memory import apply_heap_trim, apply_offload, apply_recompute


@dataclass(frozen=True)
class Layout:
    """This process's place in the mesh; the default is one process."""

    rank: int = 0
    world: int = 1
    cp: ContextParallel | None = None

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

    @property
    def dp_size(self) -> int:
        return self.world // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    def shard(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """This rank's context shard of each ``[B, T, ...]`` tensor (all of it without CP)."""
        if self.cp is None:
            return list(tensors)
        start, end = self.cp.shard(tensors[0].shape[1])
        return [t[:, start:end] for t in tensors]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over every rank (no gradient)."""
        return x.detach() if self.world == 1 else summed(x)


def make_layout(context_parallel: int = 1, device_type: str = "cpu") -> Layout:
    """The layout of this process; needs an initialised process group when ``world > 1``."""
    if not (dist.is_available() and dist.is_initialized()):
        if context_parallel > 1:
            raise ValueError("context parallelism needs torch.distributed (launch with --devices)")
        return Layout()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % context_parallel:
        raise ValueError(f"{world} ranks do not split into context groups of {context_parallel}")
    if context_parallel == 1:
        return Layout(rank, world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // context_parallel, context_parallel),
                            mesh_dim_names=("data", "context"))
    cp = ContextParallel(mesh.get_local_rank("context"), context_parallel,
                         mesh.get_group("context"))
    return Layout(rank, world, cp)


def parallelize(model: torch.nn.Module, layout: Layout, recompute: str = "none",
                offload: bool = False, trim_heap: bool = False) -> torch.nn.Module:
    """Context parallelism, then activation recompute, then offload, then heap trimming: the fixed
    order (each wraps what the previous one installed)."""
    apply_context_parallel(model, layout.cp)
    apply_recompute(model, recompute)
    if offload:
        apply_offload(model)
    apply_heap_trim(model, trim_heap)
    return model


@dataclass
class StepLoss:
    """``objective``: what this rank backpropagates; the rest are global, detached, for logging."""

    objective: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    n_tokens: int


def objective(out, layout: Layout) -> StepLoss:
    """This rank's share of the global batch's loss from its :class:`~megabase.model.LMOutput`."""
    if layout.world == 1:
        return StepLoss(out.loss, out.lm_loss.detach(), out.aux_loss.detach(), out.n_tokens)
    local = out.lm_loss * out.n_tokens  # the summed NLL of this rank's targets
    sums = layout.sum(torch.stack([local.detach().float(), out.aux_loss.detach().float(),
                                   torch.tensor(float(out.n_tokens))]))
    n = max(int(sums[2]), 1)
    share = local / n + out.aux_loss / layout.dp_size
    return StepLoss(share * layout.world, sums[0] / n, sums[1] / layout.dp_size, int(sums[2]))


def trainer_kwargs(devices: int, num_nodes: int, accelerator: str = "auto") -> dict:
    """``pl.Trainer`` arguments for ``devices`` processes on each of ``num_nodes`` nodes: DDP over
    NCCL on GPUs, over gloo on CPUs; a plain single-device trainer for one process."""
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if devices * num_nodes == 1:
        return {"accelerator": accelerator, "devices": 1}
    from lightning.pytorch.strategies import DDPStrategy

    backend = "nccl" if accelerator == "gpu" else "gloo"
    return {"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes,
            "strategy": DDPStrategy(process_group_backend=backend), "use_distributed_sampler": False}
