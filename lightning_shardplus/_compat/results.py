"""Lightning's logged results, through their private names: the ``_ResultCollection`` of each loop and its
``_ResultMetric`` values, the logger connector that publishes them (exact evaluation's epoch values, the averaged
training metrics' step values). ``tests/test_lightning_private.py`` fails if one moves; the probes in
``_compat/lightning.py`` name the feature that cannot run."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_shardplus._compat.lightning import _private

_LoggerConnector = _private("lightning.pytorch.trainer.connectors.logger_connector", "_LoggerConnector")
_ResultCollection = _private("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection")
# One logged key in a `_ResultCollection` (Lightning's `_ResultMetric`, not imported): read and written through the
# attributes `_probe_results` checks on one Lightning filled.
ResultMetric = Any


# ---------------------------------------------------------------- logged results (exact evaluation)
# `trainer._results` (a `_ResultCollection`) holds one `_ResultMetric` per key: its running `value` and
# `cumulated_batch_size`, and the `_computed` epoch value the loggers read; exact evaluation writes the latter.


def active_results(trainer: Any) -> Any:
    """The result collection of the loop now running (private ``trainer._results``)."""
    return trainer._results


def epoch_result_metrics(results: Any) -> dict[str, Any]:
    """Key -> ``_ResultMetric`` for every value logged this epoch that has an epoch-level value."""
    return {key: metric for key, metric in results.items() if not metric.has_reset and metric.meta.on_epoch}


def log_placeholder(results: Any, description: dict[str, Any], value: Any, sync_dist_fn: Any) -> Any:
    """Register ``description``'s key on a rank that never logged it (e.g. one with no evaluation batch), with
    a value that does not change the reduction (``batch_size=0``); returns its ``_ResultMetric``. Lightning's own
    ``log``, not an instance patch's (:func:`intercept_training_logs`)."""
    previous_idx = results.dataloader_idx
    results.dataloader_idx = description["dataloader_idx"]
    try:
        type(results).log(
            results,
            description["fx"],
            description["name"],
            value,
            prog_bar=description["prog_bar"],
            logger=description["logger"],
            on_step=description["on_step"],
            on_epoch=True,
            reduce_fx=description["reduction"] if description["reduction"] != "metric" else "mean",
            sync_dist=description["sync_dist"],
            sync_dist_fn=sync_dist_fn,
            add_dataloader_idx=description["add_dataloader_idx"],
            batch_size=0,
            metric_attribute=description["metric_attribute"],
        )
    finally:
        results.dataloader_idx = previous_idx
    return results[description["key"]]


def set_computed(result_metric: Any, value: Any) -> None:
    """Make ``value`` the epoch value Lightning reports (in place where cached: the loggers' copies are views)."""
    cached = result_metric._computed
    if cached is not None and cached.shape == value.shape:
        cached.copy_(value)
    else:
        result_metric._computed = value


def publish_loader_values(trainer: Any, dataloader_idx: int | None) -> None:
    """Publish evaluation loader ``dataloader_idx``'s epoch values (``callback_metrics``, logged, progress bar), as
    Lightning does when its loop moves to the next loader."""
    results = trainer._results
    current, results.dataloader_idx = results.dataloader_idx, dataloader_idx
    try:
        trainer._logger_connector.update_eval_epoch_metrics()
    finally:
        results.dataloader_idx = current


# ---------------------------------------------------------------- training metrics (`training_metrics`)
# No public hook sits between "a value was logged" and "it is read"; `sync_dist` runs in `_ResultCollection.log`.


class TrainingLog(NamedTuple):
    """One ``self.log`` call into the training results, with the arguments as ``LightningModule.log`` resolved
    them (``on_step``/``on_epoch`` defaults applied; ``sync_dist`` already False outside distributed runs)."""

    fx: str
    name: str
    key: str
    is_tensor: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    sync_dist_group: Any
    rank_zero_only: bool
    batch_size: int | None


class LoggedValue(NamedTuple):
    """A training value taken over by the caller of :func:`intercept_training_logs`, once Lightning stored
    it."""

    log: TrainingLog
    metric: ResultMetric
    value: torch.Tensor  # this rank's value, as Lightning stored it for the step (floating point, not in a graph)
    reduce_fx: str  # "mean", "sum", "max" or "min": the epoch reduction (and Lightning's cross-rank op)
    # The metric's epoch accumulation (value, cumulated batch size or None) before this call; None unless
    # on_epoch.
    epoch_state_before: tuple[torch.Tensor, torch.Tensor | None] | None


def synced_by_shardplus(value: Any, *_: Any, **__: Any) -> Any:
    """The identity, as ``sync_dist_fn`` of the values shardplus reduces itself (``sync_dist`` stays True, so
    Lightning does not warn that their epoch values are unsynced)."""
    return value


def training_results(trainer: pl.Trainer) -> _ResultCollection:
    """The training loop's result collection (``trainer._results`` while training; one object per Trainer)."""
    return trainer.fit_loop.epoch_loop._results  # private: `_TrainingEpochLoop._results`


def intercept_training_logs(
    results: _ResultCollection,
    take: Callable[[TrainingLog], bool],
    taken: Callable[[LoggedValue], None],
) -> Callable[[], None]:
    """Route every ``self.log`` into ``results`` (``_ResultCollection.log``) through ``take``: a call it accepts
    is stored by Lightning with no sync, then handed to ``taken`` with its epoch state before; returns the undo."""
    if "log" in vars(results):
        raise RuntimeError("shardplus: the training results are already intercepted (two metric averagers?)")
    original = results.log  # private: `_ResultCollection.log`
    parameters = inspect.signature(original).parameters
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}

    def log(fx: str, name: str, value: Any, **kwargs: Any) -> None:
        arguments = {**defaults, **kwargs}
        key = f"{fx}.{name}"  # the storage key `_ResultCollection.log` builds
        if arguments["add_dataloader_idx"] and results.dataloader_idx is not None:
            key += f".{results.dataloader_idx}"
        call = TrainingLog(
            fx=fx,
            name=name,
            key=key,
            is_tensor=isinstance(value, torch.Tensor),
            on_step=bool(arguments["on_step"]),
            on_epoch=bool(arguments["on_epoch"]),
            sync_dist=bool(arguments["sync_dist"]),
            sync_dist_group=arguments["sync_dist_group"],
            rank_zero_only=bool(arguments["rank_zero_only"]),
            batch_size=arguments["batch_size"],
        )
        if not take(call):
            return original(fx, name, value, **kwargs)
        existing = results.get(key)
        before = epoch_state(existing) if existing is not None and call.on_epoch else None
        original(fx, name, value, **{**kwargs, "sync_dist": True, "sync_dist_fn": synced_by_shardplus})
        metric = results[key]
        if call.on_epoch and before is None:
            before = _default_epoch_state(metric)
        value = metric._forward_cache  # private: the step value `_ResultMetric.update` stored (float, not synced)
        taken(LoggedValue(call, metric, value, _reduce_name(metric), before))

    # like `_ResultCollection.log` itself: a compiled `training_step` breaks the graph here
    log = torch.compiler.disable(log)
    # an instance patch: Lightning has no hook between "a value is logged" and "its sync runs and it is read"
    results.log = log  # type: ignore[method-assign]

    def restore() -> None:
        if vars(results).get("log") is log:
            del results.log

    return restore


def _reduce_name(metric: ResultMetric) -> str:
    meta = metric.meta  # private: `_Metadata`
    if meta.is_mean_reduction:
        return "mean"
    if meta.is_sum_reduction:
        return "sum"
    if meta.is_max_reduction:
        return "max"
    return "min"


def epoch_state(metric: ResultMetric) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A copy of the epoch accumulation of ``metric``: ``value`` (the running sum of value * batch size for
    ``reduce_fx="mean"``, else the running sum/max/min) and ``cumulated_batch_size`` (mean only)."""
    count = metric.cumulated_batch_size.clone() if metric.meta.is_mean_reduction else None
    return metric.value.clone(), count


def _default_epoch_state(metric: ResultMetric) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The epoch state of a fresh ``_ResultMetric``: 0, or -inf/+inf for max/min."""
    name = _reduce_name(metric)
    fill = {"max": float("-inf"), "min": float("inf")}.get(name, 0.0)
    count = torch.zeros_like(metric.cumulated_batch_size) if name == "mean" else None
    return torch.full_like(metric.value, fill), count


def set_step_value(metric: ResultMetric, value: torch.Tensor | None) -> None:
    """Make ``value`` the step value the loggers read (None: no step value yet, left out of them)."""
    metric._forward_cache = value  # private: read by `_ResultCollection._get_cache(on_step=True)`
    if value is not None:
        metric.has_reset = False  # private: as `update_metrics` does; a reset metric is left out of the values
        if not metric.meta.on_epoch:
            metric.value = value  # what `update` stores for on_step-only values


def publish_step_values(trainer: pl.Trainer, results: _ResultCollection) -> None:
    """Copy the training step values of ``results`` into ``callback_metrics``, ``progress_bar_metrics`` and
    ``logged_metrics``, as Lightning does after each training batch (``_LoggerConnector.on_batch_end``): for values
    written later, before validation or the epoch end read those (as ``LearningRateMonitor`` adds its own)."""
    values = results.metrics(True)  # on_step: the step values, under the names Lightning gives them
    trainer.callback_metrics.update(values["callback"])
    trainer.progress_bar_metrics.update(values["pbar"])
    trainer.logged_metrics.update(values["log"])


def set_epoch_state(metric: ResultMetric, value: torch.Tensor, cumulated_batch_size: torch.Tensor | None) -> None:
    """Replace the epoch accumulation of ``metric`` (see :func:`epoch_state`)."""
    metric.value = value
    if cumulated_batch_size is not None:
        metric.cumulated_batch_size = cumulated_batch_size
    metric._computed = None  # torchmetrics' cache of `compute()`
    metric.has_reset = False  # private: the epoch value includes this state (`_ResultCollection.valid_items`)


def batch_size_of_current_batch(results: _ResultCollection) -> int | None:
    """The batch size Lightning uses for this batch's epoch means when ``self.log`` is given none; None when the
    batch has no tensor."""
    if results.batch_size is not None:  # private: cached by `_ResultCollection._extract_batch_size`
        return int(results.batch_size)
    batch = results.batch  # private: set by the logger connector's `on_batch_start`
    if batch is None:
        return None
    # the first tensor `extract_batch_size` finds, where it is the batch or its first element (the common case)
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if isinstance(first, torch.Tensor):
        return first.size(0) if first.ndim else 1
    try:
        return int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError):
        return None


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the training metrics are logged at the end of this batch (``update_train_step_metrics``' rule: not
    inside an accumulation window in automatic optimization)."""
    if trainer.accumulate_grad_batches == 1:  # no accumulation window: every batch is logged
        return True
    accumulating = trainer.fit_loop._should_accumulate()  # private: `_FitLoop._should_accumulate`
    return not (accumulating and trainer.lightning_module.automatic_optimization)


def loggers_read_this_step(trainer: pl.Trainer, logs: bool | None = None) -> bool:
    """Whether the loggers read the training metrics at the end of this batch (on the host anyway), as
    ``update_train_step_metrics`` decides after ``on_train_batch_end``; ``logs``: :func:`logs_this_step`'s answer."""
    if not (logs_this_step(trainer) if logs is None else logs):
        return False
    if trainer.fast_dev_run:
        return True
    # `_LoggerConnector.should_update_logs` while the fit loop runs, without its loop lookups (read every step)
    every = trainer.log_every_n_steps
    if not every:
        return False
    # not `or trainer.should_stop`, which Lightning adds: a rank may set it alone (it trains on to `min_epochs`), and
    # what is decided here must be the same on every rank (the names are checked at the epoch end anyway)
    return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0  # private


def ends_epoch(trainer: pl.Trainer) -> bool:
    """Whether the training epoch ends after this batch: its last batch (Lightning's data fetcher has looked one
    batch ahead), or ``max_steps`` reached (asked after the optimizer step)."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # set before the batch runs
    return bool(last) or 0 < trainer.max_steps <= trainer.global_step


def checkpoints_within_epochs(checkpoint: Any) -> bool:
    """Whether a ``ModelCheckpoint`` may save after a training batch (``every_n_train_steps`` or
    ``train_time_interval``), reading ``callback_metrics`` there for its monitor and file name. Read from its public
    ``state_key``, which spells both out (the attributes are private)."""
    key = checkpoint.state_key  # "ModelCheckpoint{'monitor': ..., 'every_n_train_steps': 0, ...}"
    return "'every_n_train_steps': 0," not in key or "'train_time_interval': None" not in key
