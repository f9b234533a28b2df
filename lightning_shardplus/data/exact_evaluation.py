"""Exact evaluation: values logged per evaluation batch are reduced across ranks once, at the epoch end, from each
rank's running sums and counts, as a single-process run would compute them (docs/exact-evaluation.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

from lightning_shardplus._compat import results as _results
from lightning_shardplus._compat import warnings as false_warnings
from lightning_shardplus._compat.changes import Change, RunChanges
from lightning_shardplus.data import epoch_values

# Where evaluation values are logged per batch; values logged in epoch-level hooks keep Lightning's handling.
_PER_BATCH_FX = frozenset(
    f"{prefix}{stage}_{fx}" for prefix in ("", "on_") for stage in ("validation", "test")
    for fx in ("step", "batch_start", "batch_end")
)  # fmt: skip


def _not_distributed() -> bool:
    """The ``distributed_available_fn`` of a Metric whose sync exact evaluation defers: its syncs stay local."""
    return False


def defer_metric_sync(metric: Metric, changes: RunChanges) -> None:
    """Switch ``metric``'s syncs off (in ``compute()``, and in ``forward`` with ``dist_sync_on_step``) until
    ``changes`` are undone. ``sync_on_compute`` alone does not do it: torchmetrics copies it into what ``compute()``
    reads at construction and after each ``forward`` only (a metric fed by ``update`` would still sync), while
    ``compute()`` asks ``distributed_available_fn`` at every sync."""
    settings = {"sync_on_compute": False, "dist_sync_on_step": False, "distributed_available_fn": _not_distributed}
    for name, value in settings.items():
        changes.set(Change.METRIC_SYNC, metric, name, value)


def _exactly_reduced(results: Any) -> dict[str, Any]:
    """The epoch values of ``results`` that exact evaluation reduces, by key: those logged per batch, for all ranks."""
    metrics = _results.epoch_result_metrics(results).items()
    return {k: rm for k, rm in metrics if rm.meta.fx.split(".")[0] in _PER_BATCH_FX and not rm.meta.sync.rank_zero_only}


class _ExactEvaluation(Callback):
    """Exact evaluation in Lightning (added by the strategy on more than one process): while :attr:`deferring` (an
    evaluation run) neither ``reduce`` nor torchmetrics sync; at the epoch end every rank joins one reduction, then
    each Metric's sync in key order (the same collectives whatever its shard). Details: docs/exact-evaluation.md."""

    def __init__(self) -> None:
        self.deferring = False
        # id -> a deferred Metric's own `distributed_available_fn` (by id: a Metric's hash follows its state)
        self._available: dict[int, Callable[[], bool] | None] = {}
        self._silenced: set[str] = set()  # names whose sync_dist advice is ignored until `_close`
        self._changes = RunChanges()  # the Metrics' sync settings and the warning filters, for one evaluation

    def _close(self, trainer: pl.Trainer) -> None:
        self.deferring = False
        self._changes.undo()
        self._silenced.clear()
        self._available.clear()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.deferring = True
        for metric in pl_module.modules():
            if isinstance(metric, Metric) and id(metric) not in self._available:
                self._available[id(metric)] = metric.distributed_available_fn
                defer_metric_sync(metric, self._changes)

    on_test_start = on_validation_start

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # before Lightning reads the epoch values (after the last batch of each loader)
        names = {rm.meta.name for rm in _exactly_reduced(_results.active_results(trainer)).values()}
        if new := names - self._silenced:
            self._changes.apply(Change.WARNING_FILTERS, false_warnings.silence_epoch_sync_advice(new))
            self._silenced |= new

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.reduce_epoch(trainer, pl_module)
        finally:
            self._close(trainer)

    on_test_epoch_end = on_validation_epoch_end

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(trainer)

    def reduce_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank: the epoch values over all ranks (:func:`epoch_values.reduce_epoch_values`), then those of each
        loader but the last published again."""
        results = _results.active_results(trainer)
        # each deferred Metric syncs here as its own `distributed_available_fn` says
        entries = epoch_values.reduce_epoch_values(
            trainer, pl_module, results, _exactly_reduced(results), distributed_available=self._available
        )
        # Lightning published the values of each loader but the last when its loop moved on (before this
        # reduction; those of a loader without a batch here never): publish them again, on every rank.
        for dataloader_idx in {entry["dataloader_idx"] for entry in entries.values()} - {results.dataloader_idx}:
            _results.publish_loader_values(trainer, dataloader_idx)


# The name to import. The class's own name is private so that the `shardplus` command (jsonargparse) does not
# offer it among the callbacks to add: the strategy adds it where it applies.
ExactEvaluation = _ExactEvaluation
