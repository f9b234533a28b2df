"""Exact evaluation: values logged per evaluation batch are reduced across ranks once, at the epoch end, from each
rank's running sums and counts, as a single-process run would compute them (docs/exact-evaluation.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

from lightning_shardplus import _lightning, false_warnings

# Where evaluation values are logged per batch; values logged in epoch-level hooks keep Lightning's handling.
_PER_BATCH_FX = frozenset(
    f"{prefix}{stage}_{fx}" for prefix in ("", "on_") for stage in ("validation", "test")
    for fx in ("step", "batch_start", "batch_end")
)  # fmt: skip

_IDENTITY = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def reduction_of(meta: Any, is_tensor: bool) -> str:
    """``"mean" | "sum" | "max" | "min"`` for a logged tensor, ``"metric"`` for a torchmetrics ``Metric``."""
    if not is_tensor:
        return "metric"
    for kind in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{kind}_reduction"):
            return kind
    raise ValueError(f"unsupported reduce_fx {meta.reduce_fx!r} for {meta.name!r}")


def combine(reduction: str, values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The global epoch value from each rank's running value (a weighted sum for "mean") and sample count."""
    if reduction == "mean":
        return values.sum() / counts.sum()
    if reduction not in ("sum", "max", "min"):
        raise ValueError(f"unknown reduction {reduction!r}")
    return getattr(values, reduction)()


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


def _exactly_reduced(results: Any) -> dict[str, Any]:
    """The epoch values of ``results`` that exact evaluation reduces, by key: those logged per batch, for all ranks."""
    metrics = _lightning.epoch_result_metrics(results).items()
    return {k: rm for k, rm in metrics if rm.meta.fx.split(".")[0] in _PER_BATCH_FX and not rm.meta.sync.rank_zero_only}


class ExactEvaluation(Callback):
    """Exact evaluation in Lightning (added by the strategy on more than one process): while :attr:`deferring` (an
    evaluation run) neither ``reduce`` nor torchmetrics sync; at the epoch end every rank joins one reduction, then
    each Metric's sync in key order (the same collectives whatever its shard). Details: docs/exact-evaluation.md."""

    def __init__(self) -> None:
        self.deferring = False
        self._metric_flags: dict[Metric, tuple[bool, bool]] = {}
        self._silenced: set[str] = set()  # names whose sync_dist advice is ignored until `_close`
        self._restore_warnings: list[Callable[[], None]] = []

    def _close(self, trainer: pl.Trainer) -> None:
        self.deferring = False
        for restore in self._restore_warnings:
            restore()
        self._restore_warnings.clear()
        self._silenced.clear()
        for metric, (sync_on_compute, dist_sync_on_step) in self._metric_flags.items():
            _lightning.set_metric_sync(metric, sync_on_compute, dist_sync_on_step)
        self._metric_flags.clear()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.deferring = True
        for metric in pl_module.modules():
            if isinstance(metric, Metric):
                self._metric_flags[metric] = (metric.sync_on_compute, metric.dist_sync_on_step)
                _lightning.set_metric_sync(metric, sync_on_compute=False, dist_sync_on_step=False)

    on_test_start = on_validation_start

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # before Lightning reads the epoch values (after the last batch of each loader)
        names = {rm.meta.name for rm in _exactly_reduced(_lightning.active_results(trainer)).values()}
        if new := names - self._silenced:
            self._restore_warnings.append(false_warnings.silence_epoch_sync_advice(new))
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
        """Every rank: agree on the logged keys, register the ones this rank lacks, then reduce the running
        values in one all_gather and the torchmetrics Metrics with their own sync, in key order."""
        results = _lightning.active_results(trainer)
        local = {key: describe(key, rm) for key, rm in _exactly_reduced(results).items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        entries = dict(sorted({k: v for rank_entries in gathered for k, v in rank_entries.items()}.items()))
        if not entries:
            return
        for rank_entries in gathered:  # list-state layouts from any rank that has them
            for key, entry in rank_entries.items():
                entries[key]["list_states"].update(entry["list_states"])
        result_metrics = {
            key: results[key] if key in local else self._register(results, entry, pl_module, trainer)
            for key, entry in entries.items()
        }
        tensor_keys = [key for key, entry in entries.items() if entry["reduction"] != "metric"]
        if tensor_keys:
            local_values = torch.stack(
                [torch.stack([rm.value.double(), getattr(rm, "cumulated_batch_size", torch.tensor(0)).double()])
                 for rm in map(result_metrics.get, tensor_keys)]
            ).to(trainer.strategy.root_device)  # fmt: skip
            everyone = [torch.empty_like(local_values) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, local_values)
            stacked = torch.stack(everyone).cpu()  # ranks x keys x (value, count)
            for i, key in enumerate(tensor_keys):
                exact = combine(entries[key]["reduction"], stacked[:, i, 0], stacked[:, i, 1])
                rm = result_metrics[key]
                _lightning.set_computed(rm, exact.to(dtype=rm.value.dtype, device=rm.value.device))

        for key, entry in entries.items():
            if entry["reduction"] == "metric":
                metric = result_metrics[key].value
                fill_empty_list_states(metric, entry["list_states"])
                with metric.sync_context(should_sync=True, should_unsync=True):
                    value = type(metric).compute(metric)
                _lightning.set_computed(result_metrics[key], torch.as_tensor(value))
        # Lightning published the values of each loader but the last when its loop moved on (before this
        # reduction; those of a loader without a batch here never): publish them again, on every rank.
        for dataloader_idx in {entry["dataloader_idx"] for entry in entries.values()} - {results.dataloader_idx}:
            _lightning.publish_loader_values(trainer, dataloader_idx)

    def _register(self, results: Any, entry: dict[str, Any], pl_module: pl.LightningModule, trainer: pl.Trainer) -> Any:
        if entry["reduction"] == "metric":
            value: Any = pl_module.get_submodule(entry["metric_attribute"])
        else:
            value = torch.tensor(_IDENTITY[entry["reduction"]], device=trainer.strategy.root_device)
        return _lightning.log_placeholder(results, entry, value, trainer.strategy.reduce)


def share_rank_zero_buffers(module: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> None:
    """Before evaluating mid-fit, give every rank rank 0's buffers (BatchNorm running statistics), as DDP's next
    forward would: each rank's last training step updated its own copy, and exact evaluation skips DDP."""
    sync = ddp_kwargs.get("forward_sync_buffers")  # DDP: None is its default, True
    if ddp_kwargs.get("broadcast_buffers", True) if sync is None else sync:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)
