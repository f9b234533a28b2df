"""Who reads the training step values, decided from the Trainer before a fit (then agreed by the ranks):
:mod:`training_metrics` averages a step's values over the ranks only where something reads them. Loggers read at
their logging steps (``log_every_n_steps``); the rest is below. docs/training-metrics.md, "When the collective runs"."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar

from lightning_shardplus import _lightning

_PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)  # fmt: skip
_OURS_OR_LIGHTNINGS = ("lightning.", "pytorch_lightning.", "lightning_shardplus.")


def reads_every_step(trainer: pl.Trainer) -> bool:
    """Whether something may read the training values after any optimizer step: the progress bar, a
    ``ModelCheckpoint`` that saves within epochs, a ``ReduceLROnPlateau`` stepped per step, the LightningModule's
    ``on_train_batch_end``, or a callback with a per-batch hook of your own (unless its class says
    ``reads_step_values = False``). Lightning's other callbacks and shardplus's read them at most at epoch ends.

    >>> reads_every_step(pl.Trainer(logger=False, enable_progress_bar=False))  # its ModelCheckpoint: at epoch ends
    False
    """
    module = trainer.lightning_module
    if module is not None and _yours(module, "on_train_batch_end"):
        return True
    if any(config.reduce_on_plateau and config.interval == "step" for config in trainer.lr_scheduler_configs):
        return True
    for callback in trainer.callbacks:
        if (declared := getattr(callback, "reads_step_values", None)) is not None:
            reads = bool(declared)
        else:
            reads = any(_yours(callback, hook) for hook in _PER_BATCH_HOOKS)
            if isinstance(callback, ProgressBar):
                reads = reads or getattr(callback, "refresh_rate", 1) > 0
            elif isinstance(callback, ModelCheckpoint):
                reads = reads or _lightning.checkpoints_within_epochs(callback)
        if reads:
            return True
    return False


def _yours(instance: Any, hook: str) -> bool:
    """Whether ``hook`` of ``instance`` is code outside Lightning and shardplus: set on the instance (as
    ``LambdaCallback`` does), or defined by a class of another package."""
    if hook in vars(instance):
        return True
    defining = next((klass for klass in type(instance).__mro__ if hook in vars(klass)), None)
    return defining is not None and not defining.__module__.startswith(_OURS_OR_LIGHTNINGS)
