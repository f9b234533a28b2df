"""Who reads the training step values, decided the same on every rank before a fit: :mod:`training_metrics`
averages a step's values over the ranks only where something reads them. Loggers read at their logging steps
(``log_every_n_steps``); the rest is below. docs/training-metrics.md, "When the collective runs"."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar

from lightning_shardplus import _lightning

_PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)  # fmt: skip
_OURS_OR_LIGHTNINGS = ("lightning.", "pytorch_lightning.", "lightning_shardplus.")


def reads_every_step(trainer: pl.Trainer) -> bool:
    """Whether a callback may read the training values after any optimizer step: the progress bar, a
    ``ModelCheckpoint`` that saves within epochs, or a callback of your own with a per-batch hook, unless its class
    says ``reads_step_values = False``. Lightning's other callbacks and shardplus's read them at most at epoch ends."""
    for callback in trainer.callbacks:
        if (declared := getattr(callback, "reads_step_values", None)) is not None:
            reads = bool(declared)
        elif isinstance(callback, ProgressBar):
            reads = getattr(callback, "refresh_rate", 1) > 0
        elif isinstance(callback, ModelCheckpoint):
            reads = _lightning.checkpoints_within_epochs(callback)
        else:
            own = type(callback).__module__.startswith(_OURS_OR_LIGHTNINGS)
            reads = not own and any(getattr(type(callback), h) is not getattr(Callback, h) for h in _PER_BATCH_HOOKS)
        if reads:
            return True
    return False
