"""FSDP2's gradients inside an aggregation window: FSDP2 reduces none until the window's last micro-batch, and keeps
them on its units' unsharded parameters. A checkpoint inside the window saves their sum over the data-parallel ranks
(what the reduce-scatter would sum); a resume gives them back through the same public ``unshard``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_shardplus.data.group import DataParallel

try:  # public from torch 2.6: before, FSDP2's units cannot be told, and a window's gradients are not read under it
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor
except ImportError:
    FSDPModule = distribute_tensor = None  # type: ignore[assignment,misc]

# Whether a checkpoint inside a window can hold the window's gradients under FSDP2 (through its public unshard)
FSDP2_WINDOW_GRADIENTS_READABLE = FSDPModule is not None


def parameters_by_unit(module: torch.nn.Module) -> list[tuple[Any, list[str]]]:
    """``module``'s parameter names grouped by the FSDP2 unit that manages them (the innermost one above each), in
    ``named_parameters`` order; None for those of no unit, which are whole."""
    units = {path: unit for path, unit in module.named_modules() if FSDPModule and isinstance(unit, FSDPModule)}
    groups: dict[str | None, list[str]] = {}
    for name, _ in module.named_parameters():
        path = name.rpartition(".")[0]
        while path and path not in units:
            path = path.rpartition(".")[0]
        groups.setdefault(path if path in units else None, []).append(name)
    return [(units.get(path) if path is not None else None, names) for path, names in groups.items()]


@contextmanager
def unsharded(unit: Any) -> Iterator[None]:
    """Inside, the FSDP2 ``unit`` is unsharded (``FSDPModule.unshard``, public; an all-gather over the data-parallel
    ranks): its parameters are whole, and their ``.grad`` is this rank's gradient accumulated so far in an
    aggregation window (FSDP2 reduces none inside it). Nothing to do for ``None``."""
    if unit is None:
        yield
        return
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


@torch.no_grad()
def data_parallel_sum_entry(
    module: torch.nn.Module, data_parallel: DataParallel, done: int, frequency: int
) -> dict[str, Any] | None:
    """The checkpoint entry of a save inside a window under FSDP2: the gradients accumulated so far, summed over the
    data-parallel ranks (what the window's reduce-scatter would sum), whole, on CPU, on rank 0; one unit unsharded
    and one gradient reduced at a time. None on other ranks, and where FSDP2 keeps a unit's gradients in a buffer of
    its own (a ``reduce_dtype`` of the unit's own): on some rank, a unit with trainable parameters has no ``.grad``
    on any of them (the resume then warns)."""
    sums, root, is_root = {}, data_parallel.global_rank(0), torch.distributed.get_rank() == 0
    unread = torch.zeros(1, device=next(module.parameters()).device)  # units whose gradients are not on `.grad`
    for unit, names in parameters_by_unit(module):
        with unsharded(unit):
            parameters = [module.get_parameter(name) for name in names]
            trainable = [p for p in parameters if p.requires_grad]
            unread += unit is not None and bool(trainable) and all(p.grad is None for p in trainable)
            for name, parameter in zip(names, parameters, strict=True):
                grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                # a copy: a replicated DTensor's full_tensor() is its local tensor, and reduce writes into its input
                whole = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
                torch.distributed.reduce(whole, dst=root, group=data_parallel.group)
                if is_root:
                    sums[name] = whole.cpu()
    torch.distributed.all_reduce(unread, op=torch.distributed.ReduceOp.MAX)
    if not is_root or unread.item():
        return None
    return {
        "micro_batches_done": done,
        "aggregation_frequency": frequency,
        "world_size": data_parallel.size,
        "data_parallel_sum": sums,
    }


@torch.no_grad()
def set_gradients(module: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    """Give ``module``'s parameters ``gradients`` (whole tensors by name), one FSDP2 unit unsharded at a time; a
    tensor-parallel parameter gets its part (a collective over its mesh)."""
    for unit, names in parameters_by_unit(module):
        with unsharded(unit):
            for name in (name for name in names if name in gradients):
                parameter = module.get_parameter(name)
                gradient = gradients[name].to(device=parameter.device, dtype=parameter.dtype)
                if hasattr(parameter, "device_mesh"):
                    gradient = distribute_tensor(gradient, parameter.device_mesh, parameter.placements)
                if parameter.grad is None:
                    parameter.grad = gradient
                else:
                    parameter.grad.copy_(gradient)
