"""Gradient aggregation: several micro-batches per optimizer step, gradient communication on the last only.

``ShardPlusStrategy(aggregation_frequency=N)`` builds on Lightning's own accumulation loop by setting
``trainer.accumulate_grad_batches = N``. Lightning then, for each window of ``N`` micro-batches of an epoch
(the last window of an epoch may be shorter):

- zeroes the gradients before the first micro-batch of the window;
- runs every micro-batch but the last inside DDP's ``no_sync`` (forward and backward): gradients accumulate
  locally in ``param.grad`` and nothing is sent;
- runs the last micro-batch (the ``N``-th, or the final one of the epoch) normally, so DDP's backward
  all-reduces the window's accumulated gradient once, through the communication hook if one is registered;
  then steps the optimizer, and LR schedulers with ``interval="step"``, once;
- divides every micro-batch's loss by ``N`` before its backward.

The last point is only right for full windows: a short last window of ``k < N`` micro-batches is still divided
by ``N`` (Lightning#19987). The strategy therefore corrects the gradient once per optimizer step, right after
the backward of the window's last micro-batch (so after the all-reduce) and before anything else sees it, by
:func:`gradient_correction`:

- ``average_aggregated_gradients=True``: ``N / k``, so the optimizer sees the mean over the ``k``
  micro-batches actually aggregated (1 for full windows);
- ``average_aggregated_gradients=False``: ``N``, so the optimizer sees their sum (Horovod's
  ``average_aggregated_gradients=False``): summed over micro-batches, still averaged over ranks.

The correction wraps the closure that Lightning hands to the optimizer step, so it runs before the precision
plugin unscales AMP gradients (it is linear, so scaling a scaled gradient is the same), before the
``on_before_optimizer_step`` hooks and before gradient clipping (which thus clips the corrected gradient).
``on_after_backward`` still sees the uncorrected, Lightning-normalized gradients of each micro-batch.

This module holds the arithmetic and the batch-size bookkeeping; it imports neither the strategy nor the other
algorithm modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


def window_length(micro_batches_done: int, frequency: int) -> int:
    """The number of micro-batches in the window whose last micro-batch is number ``micro_batches_done`` of
    the epoch (counted from 1): ``frequency`` for full windows, fewer for the short last window of an epoch.

    Lightning starts a window at every ``frequency``-th micro-batch of an epoch (it zeroes the gradients when
    ``batch_idx % frequency == 0``), so the window ending here began at micro-batch
    ``frequency * floor((done - 1) / frequency) + 1``.
    """
    if micro_batches_done < 1 or frequency < 1:
        raise ValueError(f"window_length({micro_batches_done}, {frequency}): both must be >= 1")
    return (micro_batches_done - 1) % frequency + 1


def gradient_correction(frequency: int, aggregated: int, average: bool) -> float:
    """The factor that turns Lightning's accumulated gradient (the sum of ``aggregated`` micro-batch gradients
    of ``loss / frequency``) into their mean (``average``) or their sum."""
    if not 1 <= aggregated <= frequency:
        raise ValueError(f"gradient_correction: `aggregated`={aggregated} must be in [1, {frequency}]")
    return frequency / aggregated if average else float(frequency)


@torch.no_grad()
def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing ``.grad`` in place by ``factor`` (a no-op for 1)."""
    if factor == 1:
        return
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


def check_accumulation(aggregation_frequency: int, accumulate_grad_batches: Any) -> None:
    """Refuse two different numbers of micro-batches per optimizer step, and say which argument to keep."""
    if aggregation_frequency > 1 and accumulate_grad_batches not in (1, aggregation_frequency):
        raise ValueError(
            f"ShardPlusStrategy(aggregation_frequency={aggregation_frequency}) and "
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}) set two different numbers of "
            "micro-batches per optimizer step. Use `aggregation_frequency` only (it also normalizes the "
            "short last window of an epoch correctly): remove `accumulate_grad_batches` from the Trainer."
        )


# ---------------------------------------------------------------------------------------------- batch sizes


def dataloaders(loaders: Any) -> Iterator[DataLoader]:
    """The DataLoaders inside what ``trainer.train_dataloader`` returns (a loader, or a list/dict of them)."""
    if isinstance(loaders, DataLoader):
        yield loaders
    elif isinstance(loaders, dict):
        for value in loaders.values():
            yield from dataloaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from dataloaders(value)


def micro_batches_per_step(trainer: Any) -> int:
    """Micro-batches per optimizer step.

    ``ShardPlusStrategy`` sets ``trainer.accumulate_grad_batches`` to its ``aggregation_frequency`` when a fit
    starts (the two may not differ), so they are the same count and never multiplied; before that, and with
    other strategies, the larger of the two is the one that applies.
    """
    frequency = getattr(trainer.strategy, "aggregation_frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        frequency = 1
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        accumulate = 1
    return max(frequency, accumulate)


def micro_batch_size(trainer: Any) -> int | None:
    """Samples per micro-batch on one device: the datamodule's ``per_device_batch_size`` if it has one, else
    the (first) training DataLoader's batch size; None when neither is known."""
    size = getattr(getattr(trainer, "datamodule", None), "per_device_batch_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    for loader in dataloaders(getattr(trainer, "train_dataloader", None)):
        size = loader.batch_size
        if size is None:  # a custom batch sampler
            size = getattr(loader.batch_sampler, "batch_size", None)
        if isinstance(size, int) and size >= 1:
            return size
    return None


def effective_batch_size(trainer: Any) -> int | None:
    """Samples per optimizer step over all processes: ``micro-batch size x world size x micro-batches per
    step``; None when the micro-batch size is unknown."""
    per_device = micro_batch_size(trainer)
    if per_device is None:
        return None
    return per_device * trainer.world_size * micro_batches_per_step(trainer)
