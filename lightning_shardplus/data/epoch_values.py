"""Epoch values across ranks, from each rank's running sums and counts, once at the epoch end: shared by exact
evaluation (a single-process run's values) and the averaged training metrics. Every rank agrees on the logged keys
first, so a key some rank never logged (an empty shard, a conditional name) is registered there: the collectives
match."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_shardplus._compat import results as _results
from lightning_shardplus.data.group import data_parallel

_IDENTITY = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}
# The epoch value of one key from every rank's (running value, sample count, whether it logged the key this epoch).
Combine = Callable[[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reduction_of(meta: Any, is_tensor: bool) -> str:
    """``"mean" | "sum" | "max" | "min"`` for a logged tensor, ``"metric"`` for a torchmetrics ``Metric``."""
    if not is_tensor:
        return "metric"
    for kind in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{kind}_reduction"):
            return kind
    raise ValueError(f"unsupported reduce_fx {meta.reduce_fx!r} for {meta.name!r}")


def combine(entry: dict[str, Any], values: torch.Tensor, counts: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """The value over all ranks' samples, as one process would compute it: a weighted mean, or the sum/max/min."""
    reduction = entry["reduction"]
    if reduction == "mean":
        return values.sum() / counts.sum()
    if reduction not in ("sum", "max", "min"):
        raise ValueError(f"unknown reduction {reduction!r}")
    return getattr(values, reduction)()


def combine_training(
    entry: dict[str, Any], values: torch.Tensor, counts: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """A training value's: a mean over every rank's samples; a ``sync_dist`` sum/max/min over the ranks (``entry``'s
    ``over_ranks``); any other (Lightning's epoch aggregation of one rank's calls) averaged over the ranks that
    logged it."""
    if entry["reduction"] == "mean" or entry.get("over_ranks") == entry["reduction"]:
        return combine(entry, values, counts, present)
    return values[present > 0].mean()


def list_state_layouts(metric: Metric) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Trailing shape and dtype of each list ("cat") state of ``metric`` that holds data on this rank. A rank
    without data has empty lists, which torchmetrics gathers as a 1-d float tensor: for 2-d or integer states
    the gather's collectives would not match those of the other ranks (gloo aborts)."""
    return {
        name: (tuple(state[0].shape[1:]), state[0].dtype)
        for name, state in metric.metric_state.items()
        if isinstance(state, list) and state
    }


def fill_empty_list_states(metric: Metric, layouts: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Give each empty list state of ``metric`` one empty tensor laid out as another rank's (see
    :func:`list_state_layouts`), so that every rank's sync makes the same collectives."""
    for name, (trailing, dtype) in layouts.items():
        if getattr(metric, name) == []:
            setattr(metric, name, [torch.empty((0, *trailing), dtype=dtype, device=metric.device)])


def describe(key: str, result_metric: Any) -> dict[str, Any]:
    """What another rank needs to register the same logged key (picklable, no tensors)."""
    meta = result_metric.meta
    return {
        "list_states": {} if result_metric.is_tensor else list_state_layouts(result_metric.value), "key": key,
        "fx": meta.fx.split(".")[0], "name": meta.name, "reduction": reduction_of(meta, result_metric.is_tensor),
        "prog_bar": meta.prog_bar, "logger": meta.logger, "on_step": meta.on_step, "sync_dist": meta.sync.should,
        "dataloader_idx": meta.dataloader_idx, "add_dataloader_idx": meta.add_dataloader_idx,
        "metric_attribute": meta.metric_attribute,
    }  # fmt: skip


def reduce_epoch_values(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    results: Any,
    local: dict[str, Any],
    how: Combine = combine,
    sync_dist_fn: Callable | None = None,
    notes: dict[str, dict[str, Any]] | None = None,
    distributed_available: dict[int, Callable[[], bool] | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every rank: agree on the keys of ``local`` (key -> this rank's ``_ResultMetric``) over the data-parallel ranks,
    register those this rank lacks in ``results``, then reduce the tensors' running values in one all_gather
    (``how``) and each torchmetrics Metric with its own sync, in key order; the epoch values Lightning reports are
    set. Keys are registered with ``sync_dist_fn`` (default: the strategy's ``reduce``); ``notes[key]`` joins this
    rank's entry of ``key`` (what ``how`` needs to know of it on every rank); ``distributed_available[id(metric)]``,
    where given, is what a Metric's sync asks in place of its own ``distributed_available_fn`` (exact evaluation
    switched that off). Returns the agreed entries by key."""
    dp, notes = data_parallel(trainer.strategy), notes or {}
    gathered: list[Any] = [None] * dp.size
    own = {key: describe(key, rm) | notes.get(key, {}) for key, rm in local.items()}
    dist.all_gather_object(gathered, own, group=dp.group)
    entries = dict(sorted({k: v for rank_entries in gathered for k, v in rank_entries.items()}.items()))
    if not entries:
        return entries
    for rank_entries in gathered:  # list-state layouts from any rank that has them
        for key, entry in rank_entries.items():
            entries[key]["list_states"].update(entry["list_states"])
    result_metrics = {
        key: local[key] if key in local else _register(results, entry, pl_module, trainer, sync_dist_fn)
        for key, entry in entries.items()
    }
    tensor_keys = [key for key, entry in entries.items() if entry["reduction"] != "metric"]
    if tensor_keys:
        local_values = torch.stack(
            [torch.stack([rm.value.double(), getattr(rm, "cumulated_batch_size", rm.value.new_zeros(())).double(),
                          torch.tensor(float(key in local), dtype=torch.float64, device=rm.value.device)])
             for key, rm in zip(tensor_keys, map(result_metrics.get, tensor_keys), strict=True)]
        ).to(trainer.strategy.root_device)  # fmt: skip
        everyone = [torch.empty_like(local_values) for _ in range(dp.size)]
        dist.all_gather(everyone, local_values, group=dp.group)
        stacked = torch.stack(everyone).cpu()  # ranks x keys x (value, count, present)
        for i, key in enumerate(tensor_keys):
            value = how(entries[key], stacked[:, i, 0], stacked[:, i, 1], stacked[:, i, 2])
            rm = result_metrics[key]
            _results.set_computed(rm, value.to(dtype=rm.value.dtype, device=rm.value.device))
    for key, entry in entries.items():
        if entry["reduction"] == "metric":
            metric = result_metrics[key].value
            fill_empty_list_states(metric, entry["list_states"])
            available = (distributed_available or {}).get(id(metric))  # None: the metric's own
            with metric.sync_context(
                process_group=dp.group, should_sync=True, should_unsync=True, distributed_available=available
            ):
                value = type(metric).compute(metric)
            _results.set_computed(result_metrics[key], torch.as_tensor(value))
    return entries


def _register(
    results: Any, entry: dict[str, Any], pl_module: pl.LightningModule, trainer: pl.Trainer, sync_dist_fn: Any
) -> Any:
    if entry["reduction"] == "metric":
        value: Any = pl_module.get_submodule(entry["metric_attribute"])
    else:
        value = torch.tensor(_IDENTITY[entry["reduction"]], device=trainer.strategy.root_device)
    return _results.log_placeholder(results, entry, value, sync_dist_fn or trainer.strategy.reduce)
