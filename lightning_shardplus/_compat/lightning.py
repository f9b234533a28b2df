"""Every use of a private Lightning (or argparse) name, in one place: what Lightning's own data connector, loops
and logger connector use where it has no public hook; ``tests/test_lightning_private.py`` fails if one moves, and
on a release that moved one, ``lightning_gaps`` (below) names the feature that cannot run."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
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


def _probe_results_module() -> None:
    """A result collection Lightning filled (``self.log`` ends there, with these keywords), and its values."""
    from lightning_shardplus._compat.results import _ResultCollection, synced_by_shardplus

    _imported("_ResultCollection", module=_results_module())
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
    _probe_results_module()
    results = _results_module()
    _imported("_LoggerConnector", module=results)
    _attributes(pl.Trainer, "_results")
    _attributes(results._LoggerConnector, "update_eval_epoch_metrics")
    _takes(results._LoggerConnector.update_eval_epoch_metrics, "self")
    _attributes(importlib.import_module(results._ResultCollection.__module__), "warning_cache")


def _probe_training_metrics() -> None:
    _probe_results_module()
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


def _results_module() -> Any:
    """``_compat/results.py`` (it imports this module: imported when a probe runs)."""
    from lightning_shardplus._compat import results

    return results


def _imported(*names: str, module: Any = None) -> None:
    """Raise ImportError where one of ``names`` (imported with :func:`_private`, in ``module``; default: this one) was
    not found."""
    if missing := [name for name in names if vars(module or sys.modules[__name__])[name] is None]:
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
