"""FSDP2's step on a stand-in batch: under FSDP2 a forward is a collective, so a data-parallel rank without data runs
the step on a copy of a real batch, and what that step gives counts nowhere."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_shardplus._compat.changes import Change, RunChanges


@contextmanager
def counted_nowhere(module: pl.LightningModule, changes: RunChanges, drop_logs: bool = True) -> Iterator[None]:
    """A step run only for its collectives (model parallel: a stand-in batch): its torchmetrics Metrics keep the states
    they had (list states by a copy of the list, tensors by a clone), its buffers their values (BatchNorm's running
    statistics), and with ``drop_logs`` what it logs is dropped."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [{k: list(v) if isinstance(v, list) else v.clone() for k, v in m.metric_state.items()} for m in metrics]
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    dropped = changes.scoped(Change.LOGS_DROPPED, module, "log", lambda *args, **kwargs: None)  # `log_dict` too
    try:
        with dropped if drop_logs else nullcontext():
            yield
    finally:
        for metric, state in zip(metrics, saved, strict=True):
            for name, value in state.items():
                setattr(metric, name, value)
        # through `.data`, which autograd does not track: a training step's backward (on a loss times 0) still
        # holds the tensors its forward used, and a tracked in-place write would make it fail; the buffers stay the
        # same objects (shared ones, references elsewhere)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.data.copy_(value)
