"""Who reads the training step values, decided from the Trainer before a fit (then agreed by the ranks):
:mod:`training_metrics` averages a step's values over the ranks only where something reads them. Loggers read at
their logging steps (``log_every_n_steps``); the rest is below. docs/training-metrics.md, "When the collective runs"."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat import results as _results
from lightning_shardplus.data.aggregation import micro_batches_per_step

_PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)  # fmt: skip
_OURS_OR_LIGHTNINGS = ("lightning.", "pytorch_lightning.", "lightning_shardplus.")


def reading_interval(trainer: pl.Trainer) -> int:
    """How often something reads the training values between epoch ends, in training batches. 1: after every batch
    (a progress bar, the LightningModule's ``on_train_batch_end``, a ``ModelCheckpoint`` that saves within epochs, a
    ``ReduceLROnPlateau`` stepped per step, or a callback with a per-batch hook of your own unless its class says
    ``reads_step_values = False``). ``k`` > 1: only a ``TQDMProgressBar(refresh_rate=k)``, which reads them after every
    k-th batch and its total (unless ``training_step`` takes ``dataloader_iter``: 1). 0: nothing; Lightning's other
    callbacks and shardplus's read them at most at epoch ends. Read from the Trainer's configuration, not from what
    differs per rank (the bar's ``is_enabled``).

    >>> reading_interval(pl.Trainer(logger=False, enable_progress_bar=False))  # its ModelCheckpoint: at epoch ends
    0
    """
    module = trainer.lightning_module
    if module is not None and _yours(module, "on_train_batch_end"):
        return 1
    if any(config.reduce_on_plateau and config.interval == "step" for config in trainer.lr_scheduler_configs):
        return 1
    intervals = [_callback_interval(callback) for callback in trainer.callbacks]
    interval = 1 if 1 in intervals else max(intervals, default=0)  # (Lightning allows one progress bar)
    takes_iterator = module is not None and is_param_in_hook_signature(module.training_step, "dataloader_iter", True)
    if interval > 1 and takes_iterator:  # as Lightning decides: the bar then counts the batches its own way
        return 1
    return interval


def bar_total(trainer: pl.Trainer) -> int | None:
    """The batch of this epoch (from 1) after which a ``TQDMProgressBar`` refreshes whatever its rate: its total,
    set when the epoch starts (``max_steps`` may make it end before the loader's last batch); None without a bar or
    a finite total. The same on every rank: read from the Trainer's counters, as the bar does."""
    bar = trainer.progress_bar_callback
    total = bar.total_train_batches if isinstance(bar, TQDMProgressBar) else None
    return int(total) if total is not None and math.isfinite(total) else None


def _callback_interval(callback: Any) -> int:
    """How often ``callback`` reads the training values, in batches (0: at most at epoch ends)."""
    if (declared := getattr(callback, "reads_step_values", None)) is not None:
        return int(bool(declared))
    if any(_yours(callback, hook) for hook in _PER_BATCH_HOOKS):
        return 1
    if isinstance(callback, ProgressBar):
        rate = max(0, getattr(callback, "refresh_rate", 1))  # RichProgressBar reads every batch, whatever its rate
        return rate if isinstance(callback, TQDMProgressBar) else int(rate > 0)
    if isinstance(callback, ModelCheckpoint):
        return int(_results.checkpoints_within_epochs(callback))
    return 0


def reads_this_step(trainer: pl.Trainer, interval: int, loggers: bool, total: int | None) -> bool:
    """Whether something reads the values of the optimizer step whose last batch runs now (the same answer on every
    rank): a reader every batch; the ``loggers`` at their steps; the epoch's end; a reader every ``interval``-th
    batch (TQDM's refresh: after batch ``n``, from 1, where ``n % interval == 0 or n == total``) at that batch or a
    later one before the next step, as the step's values show until then."""
    if interval == 1 or _results.ends_epoch(trainer):
        return True
    if loggers and _results.loggers_read_this_step(trainer, True):
        return True
    if interval < 2:
        return False
    last = _lightning.micro_batches_done_in_epoch(trainer)
    shown_until = last + micro_batches_per_step(trainer) - 1  # the step's values show until the next step's
    return shown_until // interval * interval >= last or (total is not None and last <= total <= shown_until)


def _yours(instance: Any, hook: str) -> bool:
    """Whether ``hook`` of ``instance`` is code outside Lightning and shardplus: set on the instance (as
    ``LambdaCallback`` does), or defined by a class of another package."""
    if hook in vars(instance):
        return True
    defining = next((klass for klass in type(instance).__mro__ if hook in vars(klass)), None)
    return defining is not None and not defining.__module__.startswith(_OURS_OR_LIGHTNINGS)
