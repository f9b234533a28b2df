"""Every use of a private Lightning (or argparse) name, in one place: what Lightning's own data connector, loops
and logger connector use where it has no public hook; ``tests/test_lightning_private.py`` fails if one moves, and
on a release that moved one, ``lightning_gaps`` (below) names the feature that cannot run."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler, SequentialSampler


def _private(module: str, name: str) -> Any:
    """``from module import name``, or None where this Lightning moved it (its feature's probe, below, says so)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_FitLoop = _private("lightning.pytorch.loops.fit_loop", "_FitLoop")
_PrefetchDataFetcher = _private("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher")
UnrepeatedDistributedSamplerWrapper = _private(
    "lightning.pytorch.overrides.distributed", "UnrepeatedDistributedSamplerWrapper"
)
_IndexBatchSamplerWrapper = _private("lightning.pytorch.overrides.distributed", "_IndexBatchSamplerWrapper")
_parse_num_batches = _private("lightning.pytorch.trainer.connectors.data_connector", "_parse_num_batches")
_LoggerConnector = _private("lightning.pytorch.trainer.connectors.logger_connector", "_LoggerConnector")
_ResultCollection = _private("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection")
# One logged key in a `_ResultCollection` (Lightning's `_ResultMetric`, not imported): read and written through the
# attributes `_probe_results` checks on one Lightning filled.
ResultMetric = Any
_update_dataloader = _private("lightning.pytorch.utilities.data", "_update_dataloader")
_MultiProcessingLauncher = _private(
    "lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"
)


class InjectedSeed(int):
    """The ``seed`` in the strategy's ``distributed_sampler_kwargs``: found as ``.seed`` of a DistributedSampler, it
    tells one Lightning injected from one the user built (left alone)."""


def is_injected(sampler: Any) -> bool:
    """Whether ``sampler`` is a DistributedSampler that Lightning built with the strategy's kwargs."""
    return isinstance(sampler, DistributedSampler) and isinstance(sampler.seed, InjectedSeed)


def effective_sampler(dataloader: DataLoader) -> Any:
    """The sampler that orders ``dataloader`` (for prediction, inside Lightning's batch sampler)."""
    inner = getattr(dataloader.batch_sampler, "sampler", None)
    return inner if isinstance(inner, DistributedSampler) else dataloader.sampler


def injected_over_dataset_order(sampler: DistributedSampler) -> bool:
    """Whether Lightning's injected sampler shards the dataset itself, not a custom sampler of the user's."""
    if type(sampler) is DistributedSampler:
        return True
    if isinstance(sampler, UnrepeatedDistributedSamplerWrapper):  # predict: wraps the loader's own sampler
        return isinstance(sampler.dataset._sampler, SequentialSampler)  # private: `_DatasetSamplerWrapper`
    return False


def unrepeated_sampler(injected: UnrepeatedDistributedSamplerWrapper, num_replicas: int, rank: int) -> Sampler:
    """Lightning's prediction sampler over the user's sampler ``injected`` wraps, over ``num_replicas`` ranks."""
    user_sampler = injected.dataset._sampler
    return UnrepeatedDistributedSamplerWrapper(
        user_sampler, num_replicas=num_replicas, rank=rank, shuffle=injected.shuffle, seed=injected.seed
    )


def micro_batches_done_in_epoch(trainer: Any) -> int:
    """Training micro-batches started in this epoch, the running one included: the counter Lightning's accumulation
    decides with (``batch_progress.current.ready``, restored on resume; not public API)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def micro_batches_trained_in_epoch(trainer: Any) -> int:
    """Training micro-batches of this epoch whose step has run (``batch_progress.current.processed``): in
    ``on_train_batch_end`` the batch just trained counts, as in what a mid-epoch resume restores."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def refresh_training_batch_count(trainer: Any) -> bool:
    """Make Lightning's count of this epoch's training batches follow the loaders' current lengths (True if it
    changed): ``_FitLoop.setup_data`` reads them once per fit into the combined loader's ``limits``,
    ``max_batches``, ``val_check_batch`` and the fetcher's ``length``, and a resumed epoch on another world size
    has another length. Call it once the epoch's first batch is fetched."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None or combined.limits is None:
        return False
    limit_batches = trainer.limit_train_batches
    limits = [
        limit if sized_len(loader) is None else _parse_num_batches(RunningStage.TRAINING, len(loader), limit_batches)
        for loader, limit in zip(combined.flattened, combined.limits, strict=True)
    ]
    if limits == combined.limits:
        return False
    # in place: the epoch's running iterator holds this list, so the loader's own length counts with the new limits
    combined.limits[:] = limits
    fit_loop.max_batches = len(combined)
    interval = trainer.val_check_interval
    if isinstance(interval, float) and trainer.val_check_batch not in (None, float("inf")):
        # a fraction of the epoch, as `setup_data` sets it (ints and time-based intervals do not depend on it)
        trainer.val_check_batch = max(1, int(fit_loop.max_batches * interval))
    fetcher = fit_loop._data_fetcher
    if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.length is not None:
        # `fetched` counts the batches the restored progress says are done, as `_DataFetcher.__next__` does
        fetcher.length = fit_loop.max_batches
        fetcher.done = fetcher.fetched >= fetcher.length
        fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    return True


def training_loader_count(trainer: Any) -> int:
    """How many loaders the training ``CombinedLoader`` Lightning built holds (it wraps one loader too)."""
    combined = trainer.fit_loop._combined_loader
    return len(combined.flattened) if combined is not None else 1


def replace_sampler(dataloader: DataLoader, sampler: Sampler, stage: RunningStage) -> DataLoader:
    """Rebuild ``dataloader`` around ``sampler``; for prediction (already rebuilt around an index-recording batch
    sampler), swap the sampler inside that wrapper."""
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
        batch_sampler._batch_sampler.sampler = sampler  # private: the wrapped BatchSampler
        batch_sampler.sampler = sampler  # the wrapper's copy of the BatchSampler's attributes
        return dataloader
    return _update_dataloader(dataloader, sampler, mode=stage)


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


# ---------------------------------------------------------------- scaling report (`diagnostics.ScalingReport`)
# The profiler action under which Lightning's training loop times `next()` on the training loader.
TRAIN_DATALOADER_NEXT = "[_TrainingEpochLoop].train_dataloader_next"


# ---------------------------------------------------------------- DDP re-wrap (fusion autotuning)


def rewrap_ddp(strategy: Any, ddp_kwargs: dict[str, Any]) -> None:
    """Wrap the LightningModule in a new DDP with ``ddp_kwargs`` merged into the strategy's (None removes a key), as
    ``configure_ddp`` does; a collective, at the same step on every rank. No broadcast (``init_sync=False``): the
    parameters are identical on every rank at a step boundary."""
    set_ddp_kwargs(strategy, ddp_kwargs)
    user_value = strategy._ddp_kwargs.get("init_sync", _ABSENT)
    strategy._ddp_kwargs["init_sync"] = False
    try:
        strategy.model = strategy._setup_model(strategy.lightning_module)
    finally:
        if user_value is _ABSENT:
            del strategy._ddp_kwargs["init_sync"]
        else:
            strategy._ddp_kwargs["init_sync"] = user_value


_ABSENT = object()


def record_batch_without_indices(loader: Any) -> None:
    """A batch of ``loader`` that holds no sample of it (a stand-in): Lightning's index-recording batch sampler, whose
    per-batch entries prediction writers read by batch index, records an empty one."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, _IndexBatchSamplerWrapper):
        sampler.seen_batch_indices.append([])


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments the strategy gives ``DistributedDataParallel`` (read only; none under model parallel)."""
    return getattr(strategy, "_ddp_kwargs", {})


def process_launcher(strategy: Any, start_method: str) -> Any:
    """Lightning's launcher that starts the processes by fork, spawn or forkserver (the one DDPStrategy builds for
    these start methods), for ``strategy``."""
    return _MultiProcessingLauncher(strategy, start_method=start_method)


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises then; a ``Mock(spec=...)``
    module, as Lightning's launcher tests connect, gives a Mock)."""
    try:
        trainer = module.trainer
    except (AttributeError, RuntimeError):
        return None
    return trainer if isinstance(trainer, pl.Trainer) else None


def set_ddp_kwargs(strategy: Any, ddp_kwargs: dict[str, Any]) -> None:
    """Merge ``ddp_kwargs`` into the keyword arguments the strategy gives DDP (private ``_ddp_kwargs``)."""
    for key, value in ddp_kwargs.items():
        if value is None:
            strategy._ddp_kwargs.pop(key, None)
        else:
            strategy._ddp_kwargs[key] = value


def mark_resumed_step_saved(trainer: Any) -> None:
    """Tell step-triggered ModelCheckpoints the resumed step was saved (they do not restore
    ``_last_global_step_saved``: after a resume inside an aggregation window they saved again, mid-window)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    step = trainer.global_step
    for callback in trainer.checkpoint_callbacks:
        # only those that save "every n train steps" at this step: the others (at validation or epoch ends) did
        # not save at it, and the same field would make them skip their next save at this step
        every = getattr(callback, "_every_n_train_steps", 0) if isinstance(callback, ModelCheckpoint) else 0
        if every >= 1 and step % every == 0 and hasattr(callback, "_last_global_step_saved"):
            callback._last_global_step_saved = max(callback._last_global_step_saved, step)


def forget_given_warnings(pattern: str) -> None:
    """Make Lightning's logged-results module forget it gave the warnings matching ``pattern`` (it gives each once
    per process: its private ``warning_cache``), so that a later run where they are true shows them again."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    cache = result.warning_cache
    cache.difference_update([message for message in cache if re.match(pattern, message)])


def destroy_process_group() -> None:
    """Destroy the default process group if there is one, Ctrl+C ignored meanwhile: what Lightning registers at exit
    for NCCL (``lightning.fabric.utilities.distributed``), with torch's public calls."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def destroy_process_group_at_exit() -> None:
    """The process-group teardown at exit on every backend (Lightning registers its own for NCCL only; a gloo group
    alive at exit aborts now and then), not on torch < 2.13 (its gloo destructor can deadlock over the GIL). Registered
    after Lightning's, it runs first (atexit runs the last registered first): Lightning's then finds no group."""
    import atexit

    if release(torch.__version__) < (2, 13):
        return  # Lightning's behaviour

    atexit.unregister(destroy_process_group)  # once, however often it is called
    atexit.register(destroy_process_group)


# ==========================================================================================================
# Releases: the Lightning release this process runs and what differs inside the supported range
# (docs/compatibility.md). `tests/test_lightning_private.py` (section "releases") checks each.
# ==========================================================================================================

NEWEST_TESTED = (2, 6)
SUPPORTED = "2.4 to 2.6"


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``2.5.1.post0`` or ``2.7.0rc1``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


LIGHTNING_RELEASE = release(pl.__version__)
# Lightning 2.4 restores a checkpoint saved in `on_train_batch_end` with that batch not yet counted as completed
# (2.5 counts it on restart: `_TrainingEpochLoop.restarted_on_train_batch_end`): its accumulation windows then run
# one micro-batch behind the saved run, so a window's gradients cannot be put back where they were taken.
RESUMES_INSIDE_A_WINDOW = LIGHTNING_RELEASE >= (2, 5)


def warn_if_untested() -> None:
    """One warning, at import, on a Lightning release newer than the newest tested."""
    if LIGHTNING_RELEASE > NEWEST_TESTED:
        warnings.warn(
            f"lightning-shardplus was tested with Lightning {SUPPORTED}; this is {pl.__version__}. It should train; "
            "a feature whose private Lightning names moved is refused, or falls back to Lightning's behaviour with "
            "a warning naming it, when the strategy is built.",
            UserWarning,
            stacklevel=3,
        )


# ==========================================================================================================
# What this Lightning lacks, per feature: each probe reads its feature's private names on throwaway Lightning objects,
# once per process when a strategy is built (`config.fit_to_lightning` then refuses the feature or falls back).
# ==========================================================================================================


def _probe_sharding() -> None:
    """The samplers' glue (loader rebuilds, prediction wrappers, the fit loop's loaders), DDP's kwargs."""
    _imported("_FitLoop", "_PrefetchDataFetcher", "_IndexBatchSamplerWrapper", "_parse_num_batches")
    _imported("UnrepeatedDistributedSamplerWrapper", "_update_dataloader")
    sampler = SequentialSampler(range(2))
    _attributes(UnrepeatedDistributedSamplerWrapper(sampler, num_replicas=1, rank=0), "dataset._sampler", "shuffle")
    _attributes(_IndexBatchSamplerWrapper(BatchSampler(sampler, 1, drop_last=False)), "_batch_sampler")
    _takes(_parse_num_batches, "stage", "length", "limit_batches")
    _takes(_update_dataloader, "dataloader", "sampler", mode="stage")
    fit_loop = _FitLoop(None)
    _attributes(fit_loop, "_combined_loader", "_data_fetcher", "max_batches")
    _attributes(fit_loop.epoch_loop.batch_progress.current, "ready", "processed")
    _attributes(_PrefetchDataFetcher(), "length", "done", "fetched")
    _attributes(DDPStrategy(), "_ddp_kwargs")


def _probe_results() -> None:
    """A result collection Lightning filled (``self.log`` ends there, with these keywords), and its values."""
    _imported("_ResultCollection")
    results = _ResultCollection(training=True)
    results.log(
        "training_step", "probe", torch.tensor(1.0), prog_bar=False, logger=True, on_step=True, on_epoch=True,
        reduce_fx="mean", sync_dist=False, sync_dist_fn=synced_by_shardplus, sync_dist_group=None,
        add_dataloader_idx=True, batch_size=1, metric_attribute=None, rank_zero_only=False,
    )  # fmt: skip
    _attributes(results, "batch_size", "batch", "dataloader_idx")
    metric = results["training_step.probe"]
    _attributes(metric, "_computed", "_forward_cache", "has_reset", "value", "cumulated_batch_size", "meta.on_epoch")
    _attributes(metric, "meta.is_mean_reduction", "meta.is_sum_reduction", "meta.is_max_reduction")


def _probe_exact_evaluation() -> None:
    _probe_results()
    _imported("_LoggerConnector")
    _attributes(pl.Trainer, "_results")
    _attributes(_LoggerConnector, "update_eval_epoch_metrics")
    _takes(_LoggerConnector.update_eval_epoch_metrics, "self")
    _attributes(importlib.import_module(_ResultCollection.__module__), "warning_cache")


def _probe_training_metrics() -> None:
    _probe_results()
    _attributes(_FitLoop(None), "_should_accumulate", "epoch_loop._results", "epoch_loop._batches_that_stepped")
    _takes(_FitLoop._should_accumulate, "self")


def _probe_fusion_tuning() -> None:
    """Re-wrapping DDP: DDPStrategy's own ``_setup_model`` (the base's does not wrap; ``_ddp_kwargs``: sharding)."""
    if "_setup_model" not in vars(DDPStrategy):
        raise AttributeError("DDPStrategy defines no `_setup_model`")
    _takes(DDPStrategy._setup_model, "self", "model")


def _probe_process_launch() -> None:
    """Model parallel's fork/spawn launch: Lightning's multiprocessing launcher, built as DDPStrategy builds it."""
    _imported("_MultiProcessingLauncher")
    _takes(_MultiProcessingLauncher, "strategy", start_method="fork")


def _imported(*names: str) -> None:
    """Raise ImportError where one of ``names`` (imported above with :func:`_private`) was not found."""
    if missing := [name for name in names if globals()[name] is None]:
        raise ImportError(f"cannot import {', '.join(missing)}")


def _takes(function: Callable, *arguments: str, **keywords: str) -> None:
    """Raise TypeError where Lightning's private ``function`` cannot be called as shardplus calls it (with these
    arguments): a changed signature would fail mid-fit, or mean that Lightning calls it otherwise."""
    signature = inspect.signature(function)
    try:
        signature.bind(*arguments, **keywords)
    except TypeError as error:
        raise TypeError(f"`{function.__qualname__}{signature}` changed ({error})") from None


def _attributes(owner: Any, *paths: str) -> None:
    """Raise AttributeError where ``owner`` lacks one of the dotted ``paths``."""
    for path in paths:
        functools.reduce(getattr, path.split("."), owner)


# The features a Lightning release can take away, by strategy argument ("sharding": the strategy itself).
PROBES = {
    "sharding": _probe_sharding,
    "exact_evaluation": _probe_exact_evaluation,
    "average_training_metrics": _probe_training_metrics,
    "auto_tune_tensor_fusion": _probe_fusion_tuning,
    "start_method": _probe_process_launch,  # fork/spawn under model parallel (DDP's own launch needs no probe)
}


@functools.cache
def lightning_gaps() -> dict[str, str]:
    """Feature -> what its probe found missing in this Lightning (empty on every supported release)."""
    gaps = {}
    for feature, probe in PROBES.items():
        try:
            probe()
        except Exception as error:  # a moved name or a changed signature: the feature cannot run here
            gaps[feature] = f"{type(error).__name__}: {error}"
    return gaps


def parser_actions(parser: Any) -> list[Any]:
    """The actions of an argparse parser (argparse keeps no public list of them: private ``_actions``)."""
    return getattr(parser, "_actions", [])
