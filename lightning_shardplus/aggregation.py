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

:class:`GradientAggregation` is the strategy's component for one fit; the functions hold the arithmetic and the
batch-size bookkeeping. This module imports neither the strategy nor the other algorithm modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_shardplus import _lightning


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


def check_aggregation(frequency: int, trainer: Any, model: Any | None) -> None:
    """Refuse, before a fit starts, what cannot work with ``aggregation_frequency`` = ``frequency``."""
    check_accumulation(frequency, trainer.accumulate_grad_batches)
    if frequency == 1:
        return
    if model is not None and not model.automatic_optimization:
        raise ValueError(
            f"`aggregation_frequency`={frequency} needs automatic optimization, but "
            f"{type(model).__name__} sets `automatic_optimization = False`: use aggregation_frequency=1 "
            "and aggregate yourself (manual_backward inside `self.trainer.strategy.model.no_sync()` on "
            "all but the last micro-batch)."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        raise ValueError(
            f"`aggregation_frequency`={frequency} and a GradientAccumulationScheduler callback both set "
            "the micro-batches per optimizer step: use one of them (aggregation_frequency=1 to keep the "
            "scheduler)."
        )


class GradientAggregation:
    """Aggregation windows for one fit: Lightning's accumulation loop runs them (``trainer.accumulate_grad_batches``
    is set to ``frequency`` until :meth:`close` puts the user's value back), and :meth:`wrap_closure` corrects each
    window's gradient (the mean over the micro-batches actually aggregated, or their sum). ``ranks_correction``
    (micro-batches aggregated, average) -> factor corrects it further where some ranks had no
    data (``uneven.EvenSteps.gradient_correction``).

    Example::

        aggregation = GradientAggregation(trainer, frequency=4, average=True)
        closure = aggregation.wrap_closure(optimizer, closure)  # in the strategy's optimizer_step
    """

    def __init__(
        self,
        trainer: Any,
        frequency: int,
        average: bool,
        ranks_correction: Callable[[int, bool], float] | None = None,
    ) -> None:
        self.trainer, self.average, self.ranks_correction = trainer, average, ranks_correction
        self._user_accumulate = trainer.accumulate_grad_batches
        if frequency > 1:
            trainer.accumulate_grad_batches = frequency

    @property
    def micro_batches_per_step(self) -> int:
        return micro_batches_per_step(self.trainer)

    def close(self) -> None:
        """The fit ends: the Trainer's own ``accumulate_grad_batches`` again."""
        self.trainer.accumulate_grad_batches = self._user_accumulate

    def on_train_start(self, gradient_compression: str) -> None:
        """Say what one optimizer step is; after a resume, keep step-triggered checkpoints from saving mid-window."""
        trainer, micro_batches = self.trainer, self.micro_batches_per_step
        if trainer.ckpt_path is not None and micro_batches > 1:
            # resumed at an optimizer step: checkpointing "every n steps" must not save again mid-window
            _lightning.mark_resumed_step_saved(trainer)
        per_device, batch = micro_batch_size(trainer), effective_batch_size(trainer)
        rank_zero_info(
            f"shardplus: effective batch {batch or 'unknown'} = {per_device or '?'} per device x "
            f"{trainer.world_size} processes x {micro_batches} micro-batches per optimizer step "
            f"({'mean' if self.average else 'sum'} of aggregated gradients); "
            f"gradient compression {gradient_compression!r}"
        )

    def wrap_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (forward + backward of the window's last micro-batch, whose backward all-reduced the
        window's gradient), then the gradient corrected from Lightning's ``sum(loss / N)`` to the mean over the
        micro-batches actually aggregated (or their sum). Runs before unscaling, hooks and clipping."""
        trainer, frequency, ranks_correction = self.trainer, self.micro_batches_per_step, self.ranks_correction
        if frequency == 1 and ranks_correction is None:
            return closure
        if not trainer.lightning_module.automatic_optimization or not trainer.training:
            return closure

        def closure_then_normalize() -> Any:
            result = closure()
            done = _lightning.micro_batches_done_in_epoch(trainer)
            aggregated = window_length(done, frequency)
            factor = gradient_correction(frequency, aggregated, self.average)
            if ranks_correction is not None:
                factor *= ranks_correction(aggregated, self.average)
            parameters = (p for group in optimizer.param_groups for p in group["params"])
            scale_gradients(parameters, factor)
            return result

        return closure_then_normalize

    def warn_if_mid_window(self) -> None:
        """A checkpoint is saved now: say so if it is inside a window (its accumulated gradient is not in it)."""
        trainer, frequency = self.trainer, self.micro_batches_per_step
        batches_done = _lightning.micro_batches_trained_in_epoch(trainer)
        if batches_done % frequency and batches_done < trainer.num_training_batches:
            rank_zero_warn(
                f"shardplus: a checkpoint is saved after micro-batch {batches_done} of the epoch, inside an "
                f"aggregation window of {frequency}: the gradients accumulated so far are not in it, so a "
                "run resumed from it does not equal an uninterrupted one. Save at optimizer steps (ModelCheckpoint "
                "every_n_train_steps counts them)."
            )


# ---------------------------------------------------------------------------------------------- batch sizes


def dataloaders(loaders: Any) -> Iterator[DataLoader]:
    """The loaders inside what ``trainer.train_dataloader`` returns (a loader, or a list/dict of them): DataLoaders
    and what wraps one and forwards its attributes (``uneven.AgreedLoader``)."""
    if isinstance(loaders, dict):
        for value in loaders.values():
            yield from dataloaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from dataloaders(value)
    elif isinstance(loaders, DataLoader) or isinstance(getattr(loaders, "loader", None), DataLoader):
        yield loaders


def micro_batches_per_step(trainer: Any) -> int:
    """Micro-batches per optimizer step: Lightning's ``accumulate_grad_batches`` (``ShardPlusStrategy`` sets it
    to its ``aggregation_frequency`` for the fit: they are one count, never multiplied)."""
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        return 1
    return accumulate


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
