"""DDP's steps around its forward: a rank without data (``uneven_inputs="join"``) trains on a zero loss through DDP's
forward, so that DDP's all-reduce runs as on every other rank; exact evaluation skips DDP's forward, so it first gives
every rank rank 0's buffers, as DDP's next forward would."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_shardplus._compat.changes import Change, RunChanges


def zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """A zero depending on every trainable parameter: the loss of a rank without data (DDP communicates as usual)."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    if not parameters:
        return torch.zeros(())
    return torch.stack([p.sum() for p in parameters]).sum() * 0.0


def forward_without_data(ddp: torch.nn.Module, module: torch.nn.Module, changes: RunChanges) -> torch.Tensor:
    """Run ``ddp``'s forward (and its collectives) over :func:`zero_loss` instead of the module's ``forward``."""
    with changes.scoped(Change.FORWARD_WITHOUT_DATA, module, "forward", lambda *args, **kwargs: zero_loss(module)):
        return ddp()


def share_rank_zero_buffers(module: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> None:
    """Before evaluating mid-fit, give every rank rank 0's buffers (BatchNorm running statistics), as DDP's next
    forward would: each rank's last training step updated its own copy, and exact evaluation skips DDP."""
    sync = ddp_kwargs.get("forward_sync_buffers")  # DDP: None is its default, True
    if ddp_kwargs.get("broadcast_buffers", True) if sync is None else sync:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)
