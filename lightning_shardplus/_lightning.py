"""Every use of a private Lightning name, in one place.

Lightning has no public hook to choose the *class* of the distributed sampler it injects, nor a public
function to rebuild a user's DataLoader around another sampler, nor does it tell a strategy how many
micro-batches the current accumulation window holds. The names below are what its own data connector and
training loop use; ``tests/test_lightning_private.py`` fails if any of them moves.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSamplerWrapper,
    _IndexBatchSamplerWrapper,
)
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, Sampler, SequentialSampler


class InjectedSeed(int):
    """The ``seed`` the strategy hands to Lightning's sampler injection (``distributed_sampler_kwargs``).

    Lightning passes it on to the ``DistributedSampler`` it builds, which stores it as ``.seed``; finding this
    type there tells a sampler Lightning injected from one the user built (which is left alone).
    """


def is_injected(sampler: Any) -> bool:
    """Whether ``sampler`` is a DistributedSampler that Lightning built with the strategy's kwargs."""
    return isinstance(sampler, DistributedSampler) and isinstance(sampler.seed, InjectedSeed)


def effective_sampler(dataloader: DataLoader) -> Any:
    """The sampler that orders ``dataloader``: for prediction Lightning puts it inside the batch sampler
    (wrapped to record indices), leaving ``dataloader.sampler`` a default one."""
    inner = getattr(dataloader.batch_sampler, "sampler", None)
    return inner if isinstance(inner, DistributedSampler) else dataloader.sampler


def injected_over_dataset_order(sampler: DistributedSampler) -> bool:
    """Whether Lightning's injected sampler shards the dataset itself (plain or sequential order), as opposed
    to wrapping a custom sampler of the user's, whose order we must not replace."""
    if type(sampler) is DistributedSampler:
        return True
    if isinstance(sampler, UnrepeatedDistributedSamplerWrapper):  # predict: wraps the loader's own sampler
        return isinstance(sampler.dataset._sampler, SequentialSampler)  # private: `_DatasetSamplerWrapper`
    return False


def micro_batches_done_in_epoch(trainer: Any) -> int:
    """Training micro-batches started so far in the current epoch, the running one included.

    It is the counter Lightning's accumulation decides with
    (``_TrainingEpochLoop._accumulated_batches_reached``:
    ``batch_progress.current.ready % accumulate_grad_batches == 0``; gradients are zeroed when
    ``batch_idx % accumulate_grad_batches == 0`` with ``batch_idx == ready - 1``), restored on resume.
    Internal: ``trainer.fit_loop.epoch_loop.batch_progress`` is not public API.
    """
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def replace_sampler(dataloader: DataLoader, sampler: Sampler, stage: RunningStage) -> DataLoader:
    """Rebuild ``dataloader`` (its class, batch size, collate_fn, workers, ...) around ``sampler``.

    For prediction Lightning has already rebuilt the loader around a ``BatchSampler`` wrapped to record the
    indices of each batch, and cannot rebuild it again: the sampler is swapped inside that wrapper.
    """
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
        batch_sampler._batch_sampler.sampler = sampler  # private: the wrapped BatchSampler
        batch_sampler.sampler = sampler  # the wrapper's copy of the BatchSampler's attributes
        return dataloader
    return _update_dataloader(dataloader, sampler, mode=stage)


# ---------------------------------------------------------------- logged results (exact evaluation)
#
# Lightning keeps what `self.log` recorded in a private `_ResultCollection` (`trainer._results`): one
# `_ResultMetric` per key, holding the running value (`value`, `cumulated_batch_size`) and, once the epoch value
# is computed, the cached `_computed` tensor that the logger, progress bar and `callback_metrics` read. Exact
# evaluation reduces those running values across ranks itself and writes the result into `_computed`.


def active_results(trainer: Any) -> Any:
    """The result collection of the loop now running (private ``trainer._results``)."""
    return trainer._results


def epoch_result_metrics(results: Any) -> dict[str, Any]:
    """Key -> ``_ResultMetric`` for every value logged this epoch that has an epoch-level value."""
    return {key: metric for key, metric in results.items() if not metric.has_reset and metric.meta.on_epoch}


def log_placeholder(results: Any, description: dict[str, Any], value: Any, sync_dist_fn: Any) -> Any:
    """Register ``description``'s key on a rank that never logged it (e.g. one with no evaluation batch), with
    a value that does not change the reduction (``batch_size=0``); returns its ``_ResultMetric``."""
    previous_idx = results.dataloader_idx
    results.dataloader_idx = description["dataloader_idx"]
    try:
        results.log(
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
    """Make ``value`` the epoch value Lightning reports for ``result_metric``. Written in place when a value is
    cached already: the logger's and ``callback_metrics``' copies are views of it."""
    cached = result_metric._computed
    if cached is not None and cached.shape == value.shape:
        cached.copy_(value)
    else:
        result_metric._computed = value
