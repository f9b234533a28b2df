"""Averaged training metrics: each tensor logged ``on_step`` in training replaced, once per optimizer step, by its
batch-weighted mean over ranks (``sync_dist`` ones by their ``reduce_fx``): one SUM all-reduce on device tensors
(plus one MAX for max/min), no host read per step; names that differ raise :class:`MetricMismatchError`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_shardplus import _lightning

_F64, _INF = torch.float64, float("inf")
_HEADER = 2  # summed over ranks: the ranks with data, the ranks whose names differ from the layout
Signature = tuple[tuple[str, str], ...]  # sorted (key, reduction)
EpochState = tuple[Tensor, Tensor | None]


class MetricMismatchError(RuntimeError):
    """Ranks logged different training metrics in the same step; raised on every rank."""


class _Observed:
    """What this rank logged since the last reduction: each name's reduction, and (key, value, weight) in order."""

    def __init__(self) -> None:
        self.reductions: dict[str, str] = {}
        self.rows: list[tuple[str, Tensor, float]] = []  # values: 0-dim float64 on the device

    def signature(self) -> Signature:
        return tuple(sorted(self.reductions.items()))


def _on(device: torch.device, numbers: list[Any], dtype: torch.dtype = _F64) -> Tensor:
    """Host numbers on the device, the copy queued without waiting for the device."""
    return torch.tensor(numbers, dtype=dtype).to(device, non_blocking=True)


class _Layout:
    """Where each name of an agreed signature lives. SUM buffer: the header, per mean (weight * value, weight), per
    sum its value; MAX buffer: per max/min name its value (negated for min, NaN as -inf), then its NaN flag.
    ``position``: a name's index in the step's vector of values (means, sums, then max/min)."""

    def __init__(self, signature: Signature, device: torch.device) -> None:
        self.signature, self.device = signature, device
        self.reductions = dict(signature)
        means = [key for key, reduction in signature if reduction == "mean"]
        sums = [key for key, reduction in signature if reduction == "sum"]
        self.extremes = [key for key, reduction in signature if reduction in ("max", "min")]
        self.means, self.sums = len(means), len(sums)
        self.position = {key: i for i, key in enumerate(means + sums + self.extremes)}
        self.slots = {key: _HEADER + 2 * i for i, key in enumerate(means)}  # of the value, in its buffer
        self.slots |= {key: _HEADER + 2 * self.means + i for i, key in enumerate(sums)}
        self.slots |= {key: i for i, key in enumerate(self.extremes)}
        self.numel = _HEADER + 2 * self.means + self.sums
        n = len(self.extremes)
        self.identity = _on(device, [-_INF] * n + [0.0] * n) if n else None
        self.signs = _on(device, [1.0 if self.reductions[key] == "max" else -1.0 for key in self.extremes])
        self._plan: tuple[Any, tuple[Any, ...]] | None = None  # for the last order of observations

    def _plan_for(self, observed: _Observed, differs: bool) -> tuple[Any, ...]:
        """The device constants that put ``observed`` into the buffers, kept while the steps repeat the order and
        weights: the SUM buffer's header and weights; (observations, slots, factors) of the mean/sum observations
        (factor: the weight, or 1) and of the max/min ones (factor: +1 for max, -1 for min)."""
        cache_key = tuple((key, weight) for key, _, weight in observed.rows)
        if self._plan is not None and self._plan[0] == cache_key:
            return self._plan[1]
        constants = [1.0, float(differs)] + [0.0] * (self.numel - _HEADER)
        summed, maxed = [], []
        for i, (key, weight) in enumerate(cache_key):
            reduction = self.reductions.get(key)
            if reduction != observed.reductions[key]:
                continue  # not in the layout: this rank's own value
            slot = self.slots[key]
            if reduction == "mean":
                constants[slot + 1] += weight
            if reduction in ("mean", "sum"):
                summed.append((i, slot, weight if reduction == "mean" else 1.0))
            else:
                maxed.append((i, slot, 1.0 if reduction == "max" else -1.0))
        plan = (_on(self.device, constants), self._columns(summed), self._columns(maxed))
        self._plan = (cache_key, plan)
        return plan

    def _columns(self, rows: list[tuple[int, int, float]]) -> tuple[Tensor, Tensor, Tensor] | None:
        if not rows:
            return None
        observations, slots, factors = zip(*rows, strict=True)
        on = self.device
        return _on(on, list(observations), torch.long), _on(on, list(slots), torch.long), _on(on, list(factors))

    def pack(self, observed: _Observed | None, differs: bool) -> tuple[Tensor, Tensor | None]:
        """This rank's SUM buffer and MAX buffer (None in a layout without max/min names); ``observed`` None: a rank
        without data in the step, which contributes nothing."""
        maxed = None if self.identity is None else self.identity.clone()
        if observed is None:
            return torch.zeros(self.numel, dtype=_F64, device=self.device), maxed
        constants, summed_part, maxed_part = self._plan_for(observed, differs)
        summed = constants.clone()
        if summed_part is not None or maxed_part is not None:
            stacked = torch.stack([value for _, value, _ in observed.rows])
        if summed_part is not None:
            rows, slots, factors = summed_part
            summed.index_add_(0, slots, stacked.index_select(0, rows) * factors)
        if maxed is not None and maxed_part is not None:
            rows, slots, signs = maxed_part
            signed = stacked.index_select(0, rows) * signs
            maxed.scatter_reduce_(0, slots, signed.nan_to_num(nan=-_INF, posinf=_INF, neginf=-_INF), "amax")
            maxed.scatter_reduce_(0, slots + len(self.extremes), signed.isnan().to(_F64), "amax")
        return summed, maxed

    def values(self, summed: Tensor, maxed: Tensor | None) -> Tensor:
        """The reduced step value of every name, in ``position`` order (a zero total weight gives NaN)."""
        end, n = _HEADER + 2 * self.means, len(self.extremes)
        parts = []
        if self.means:
            parts.append(summed[_HEADER:end:2] / summed[_HEADER + 1 : end : 2])
        if self.sums:
            parts.append(summed[end:])
        if maxed is not None:
            parts.append(torch.where(maxed[n:] > 0, float("nan"), maxed[:n] * self.signs))
        return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else summed[:0]


class _Pending(NamedTuple):
    """A name logged since the last reduction: its last call, its reduction, its epoch state before (or None)."""

    logged: _lightning.LoggedValue
    reduction: str
    before: EpochState | None


class AverageTrainingMetrics(Callback):
    """Replaces the training values logged on each rank by their reduction over all ranks, once per optimizer step;
    put first in the Trainer's callbacks (by the strategy), before any other callback reads the metrics."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._restore: Callable[[], None] | None = None  # puts Lightning's logging back
        self._results: Any = None
        self._device = torch.device("cpu")
        self._layout: _Layout | None = None  # agreed by every rank; None before the first reduced step
        self._observed, self._pending, self._without_data, self._weight = _Observed(), {}, False, None
        self._followed: dict[str, _Pending] = {}  # logged in this rank's last step with data
        self._last: dict[str, Tensor] = {}  # each name's last reduced step value
        self._labels: dict[str, str] = {}
        self._differ: Tensor | None = None  # summed "names differ" flags since the last check, on the device
        self._first_difference: tuple[int, str, list[tuple[str, str, str]]] | None = None  # (step, where, names)
        self._steps = self._epoch = 0
        self._warned: set[str] = set()

    def abstain_this_step(self) -> None:
        """This rank has no data in this micro-batch (``uneven_inputs="join"``): it reduces without contributing."""
        self._without_data = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        self._device = trainer.strategy.root_device
        self._results = _lightning.training_results(trainer)
        self._restore = _lightning.intercept_training_logs(self._results, self._take, self._taken)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # what a batch skipped by `on_train_batch_start` returning -1 logged stays out of the next epoch
        self._epoch = trainer.current_epoch
        self._clear()

    def _take(self, log: _lightning.TrainingLog) -> bool:
        if not log.on_step or not log.is_tensor or log.rank_zero_only:
            return False
        if log.sync_dist and log.sync_dist_group is not None:
            return False  # a sync over a sub-group: Lightning's
        if log.fx != "on_train_batch_end":
            return True
        if log.key not in self._warned:
            self._warned.add(log.key)
            rank_zero_warn(
                f"shardplus: `{log.name}` is logged in `on_train_batch_end`, after the training metrics of the step "
                "were averaged across ranks (at the start of that hook, before callbacks read them): it is this "
                "rank's own value. Log it from `training_step` to average it."
            )
        return False

    def _taken(self, logged: _lightning.LoggedValue) -> None:
        log = logged.log
        reduction = logged.reduce_fx if log.sync_dist and logged.reduce_fx != "mean" else "mean"
        weight = float(log.batch_size) if log.batch_size is not None else self._batch_weight()
        self._observed.reductions[log.key] = reduction
        self._observed.rows.append((log.key, logged.value.detach().reshape(()).to(self._device, _F64), weight))
        self._labels[log.key] = f"`{log.name}` (from {log.fx})"
        previous = self._pending.get(log.key)
        self._pending[log.key] = _Pending(logged, reduction, previous.before if previous else logged.epoch_state_before)

    def _batch_weight(self) -> float:
        if self._weight is None:
            size = _lightning.batch_size_of_current_batch(self._results)
            self._weight = float(size) if size is not None else 1.0
        return self._weight

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._restore is None:
            return
        self._weight = None  # the next batch's size is inferred anew
        if not _lightning.logs_this_step(trainer):
            # inside an accumulation window: the previous step's values until this window is reduced
            for key, pending in self._pending.items():
                _lightning.set_step_value(pending.logged.metric, self._last.get(key))
            return
        try:
            self._reduce(f"epoch {self._epoch}, batch {batch_idx}")
            if _lightning.loggers_read_this_step(trainer, logs=True):
                self._check()
        finally:
            self._clear()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restore is not None:
            self._check()  # the steps since the last logging step, before the epoch values are logged

    def _reduce(self, where: str) -> None:
        """Every rank, once per optimizer step: reduce the step in the agreed layout and write the values back."""
        observed = None if self._without_data and not self._observed.rows else self._observed
        self._steps += 1
        if self._layout is None:
            self._agree(observed, where)
        assert self._layout is not None
        differs = observed is not None and observed.signature() != self._layout.signature
        summed, maxed = self._collect(observed, differs)
        if observed is None or differs:  # does every rank with data differ? A host read, on a change only
            with_data, differing = (round(x) for x in summed[:_HEADER].tolist())
            if differing and differing == with_data:
                self._agree(observed, where)
                summed, maxed = self._collect(observed, False)
            elif differs:
                self._note_difference(where)
        self._differ = summed[1] if self._differ is None else self._differ + summed[1]
        self._write(summed, maxed, observed is None)

    def _collect(self, observed: _Observed | None, differs: bool) -> tuple[Tensor, Tensor | None]:
        """This rank's buffers reduced over the ranks (on NCCL ``wait`` holds the device's stream, not the host)."""
        assert self._layout is not None
        summed, maxed = self._layout.pack(observed, differs)
        works = [dist.all_reduce(summed, op=dist.ReduceOp.SUM, async_op=True)]
        works += [] if maxed is None else [dist.all_reduce(maxed, op=dist.ReduceOp.MAX, async_op=True)]
        for work in works:
            work.wait()
        return summed, maxed

    def _entries(self, signature: Signature) -> list[tuple[str, str, str]]:
        return [(key, reduction, self._labels.get(key, f"`{key}`")) for key, reduction in signature]

    def _agree(self, observed: _Observed | None, where: str) -> None:
        """Every rank: the names of every rank with data in this step become the layout, if they are the same."""
        gathered = _gather(None if observed is None else self._entries(observed.signature()))
        signatures = {tuple((k, r) for k, r, _ in entries) for entries in gathered if entries is not None}
        if len(signatures) > 1:
            raise MetricMismatchError(describe_mismatch([entries or [] for entries in gathered], where))
        self._layout = _Layout(signatures.pop() if signatures else (), self._device)

    def _note_difference(self, where: str) -> None:
        """This rank's names differ from the layout, not every rank's: remembered for the check that raises."""
        assert self._layout is not None
        if self._first_difference is None:
            self._first_difference = (self._steps, where, self._entries(self._observed.signature()))
        outside = [k for k, r in self._observed.reductions.items() if self._layout.reductions.get(k) != r]
        if outside:
            warnings.warn(
                f"shardplus: rank {dist.get_rank()} logged {', '.join(self._labels[key] for key in outside)} at "
                f"{where}, which not every rank logged: this rank's own value(s). The names are checked when the "
                "loggers next read the values, and at the epoch end (MetricMismatchError).",
                stacklevel=1,
            )

    def _check(self) -> None:
        """Every rank, at the same step: read the summed "differ" flags since the last check (one host read); if a
        rank differed, raise :class:`MetricMismatchError` naming the first such step and the names on every rank."""
        if self._differ is None or self._layout is None:
            return
        differ, self._differ = self._differ, None
        if not differ.item():
            return
        gathered = _gather((self._first_difference, self._entries(self._layout.signature)))
        step, where, _ = min((first for first, _ in gathered if first is not None), key=lambda first: first[0])
        names = [first[2] if first is not None and first[0] == step else entries for first, entries in gathered]
        raise MetricMismatchError(describe_mismatch(names, where))

    def _write(self, summed: Tensor, maxed: Tensor | None, without_data: bool) -> None:
        """The reduced values as the step values (device tensors) and into the epoch states; a rank without data
        writes those of its last step with data."""
        assert self._layout is not None
        layout, vectors = self._layout, {}
        values = layout.values(summed, maxed)
        if self._pending:
            self._followed = dict(self._pending)
        for key, (logged, reduction, before) in (self._followed if without_data else self._pending).items():
            if layout.reductions.get(key) != reduction:
                continue  # not in the layout: this rank's own value (warned)
            local = logged.value
            vector = vectors.get((local.dtype, local.device))
            if vector is None:
                vector = vectors[(local.dtype, local.device)] = values.to(dtype=local.dtype, device=local.device)
            step = vector[layout.position[key]].reshape(local.shape)  # a new tensor: earlier reads keep theirs
            _lightning.set_step_value(logged.metric, step)
            self._last[key] = step
            if before is not None:
                before = _lightning.epoch_state(logged.metric) if without_data else before  # nothing logged: as it is
                slot = layout.slots[key]
                _lightning.set_epoch_state(
                    logged.metric, *_epoch_state(logged.reduce_fx, before, step, summed[slot : slot + 2])
                )

    def _clear(self) -> None:
        self._observed, self._pending, self._without_data, self._weight = _Observed(), {}, False, None

    def _stop(self, *_: Any, **__: Any) -> None:
        if self._restore is not None:
            self._restore()
        self._reset()

    on_train_end = on_exception = teardown = _stop


def _epoch_state(reduce_fx: str, before: EpochState, step: Tensor, sums: Tensor) -> EpochState:
    """The epoch accumulation after a reduced step: a mean adds the global (weighted sum, weight) ``sums``; sum, max
    and min apply ``reduce_fx`` to the step value."""
    value, count = before
    if reduce_fx == "mean":
        assert count is not None
        sums = sums.to(device=value.device)
        return value + sums[0].to(value.dtype), count + sums[1].round().to(count.dtype)
    step = step.to(value.dtype)
    if reduce_fx == "sum":
        return value + step, count
    return (torch.maximum if reduce_fx == "max" else torch.minimum)(value, step), count


def _gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def describe_mismatch(per_rank: Sequence[Sequence[tuple[str, str, str]]], where: str) -> str:
    """The error text for ranks that logged different metrics (``per_rank[r]``: rank r's (key, reduction, label))."""
    sets = [set(entries) for entries in per_rank]
    common = set.intersection(*sets) if sets else set()
    lines = []
    for key, reduction, label in sorted(set().union(*sets) - common):
        on = [rank for rank, entries in enumerate(sets) if (key, reduction, label) in entries]
        off = [rank for rank in range(len(sets)) if rank not in on]
        lines.append(f"{label} (reduced as {reduction}): logged on rank(s) {on}, not on rank(s) {off}")
    detail = "; ".join(lines) if lines else "the ranks' metric names differ"
    return (
        f"shardplus: ranks logged different training metrics at {where}, so they cannot be averaged without mixing "
        f"unrelated values: {detail}. Log the same names (with the same reduce_fx and sync_dist) on every rank, log "
        "rank-specific values with `rank_zero_only=True`, or set `average_training_metrics=False`."
    )
