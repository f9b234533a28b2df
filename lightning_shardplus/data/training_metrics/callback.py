"""Averaged training metrics: each tensor logged ``on_step`` in training is replaced, once per optimizer step, by its
batch-weighted mean over the ranks that logged it (``sync_dist`` ones by their ``reduce_fx``), in the optimizer steps
whose values something reads. The step's collective starts when backward begins and is waited for where the values
are first read; epoch values are each rank's running sums, reduced once at the epoch end. docs/training-metrics.md."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_shardplus._compat import results as _results
from lightning_shardplus._compat.changes import Change, RunChanges
from lightning_shardplus.data import epoch_values
from lightning_shardplus.data.group import DataParallel, data_parallel
from lightning_shardplus.data.training_metrics.errors import MetricMismatchError, describe_mismatch
from lightning_shardplus.data.training_metrics.plan import Call, ReductionPlan
from lightning_shardplus.data.training_metrics.readers import bar_total, reading_interval, reads_this_step

STALE = "\0stale:"  # in a reduction after unread steps, the section of each name's latest unread calls


def takes_over(log: _results.TrainingLog, warned: set[str]) -> bool:
    """Whether the averager takes ``log`` over: a tensor logged ``on_step`` for every rank, not synced over a
    sub-group, not from ``on_train_batch_end`` (after the step's values were averaged: warned once per key)."""
    if not log.on_step or not log.is_tensor or log.rank_zero_only:
        return False
    if log.sync_dist and log.sync_dist_group is not None:
        return False  # a sync over a sub-group: Lightning's
    if log.fx != "on_train_batch_end":
        return True
    if log.key not in warned:
        warned.add(log.key)
        rank_zero_warn(
            f"shardplus: `{log.name}` is logged in `on_train_batch_end`, after the training metrics of the step "
            "were averaged across ranks (at the start of that hook, before callbacks read them): it is this "
            "rank's own value. Log it from `training_step` to average it."
        )
    return False


def _step_value(local: Tensor, vector: Tensor, calls: Tensor, i: int, j: int | None, own: bool) -> Tensor:
    """A name's reduced step value from ``vector`` (its slot ``i``; ``j``: its latest unread steps'): with ``own``,
    the reduction; else where some rank logged it in the step, else in earlier unread steps, else ``local``."""
    if own:
        return vector[i]
    shown = local.reshape(())
    if j is not None:
        shown = torch.where(calls[j].to(local.device) > 0, vector[j], shown)
    return torch.where(calls[i].to(local.device) > 0, vector[i], shown)


class _AverageTrainingMetrics(Callback):
    """Replaces the training values logged on each rank by their reduction over the ranks, in each optimizer step
    something reads; put first in the Trainer's callbacks (by the strategy), before any other callback reads them."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._changes = RunChanges()  # Lightning's training logging, intercepted from `on_train_start` to the end
        self._results: Any = None
        self._device = torch.device("cpu")
        self._data_parallel = DataParallel(1, 0)
        self._readers: tuple[int, bool, int] = (1, False, 0)  # read every k batches, loggers?, their interval; agreed
        self._bar_total: int | None = None  # the batch of the epoch after which a TQDM bar refreshes, whatever its rate
        self._unread: tuple[Any, ...] | None = None  # the last optimizer step's state while nothing read its values
        self._stale: dict[str, list[Call]] = {}  # key -> its calls in the latest unread step that logged it
        self._after_unread = False  # an unread step came since the last reduction: its section rides along
        self._layout: dict[str, tuple[str, bool]] | None = None  # key -> (reduction, late); agreed by every rank
        self._plans: dict[str, ReductionPlan] = {}  # "early", "late" and "all" of the layout
        self._latest: dict[str, tuple[str, bool, str]] = {}  # since the agreement: (reduction, late, label) per key
        self._unplaced = False  # a call outside the layout, not yet announced in a reduction's slot 0
        self._flags: Tensor | None = None  # the summed slot 0 since the names were last checked, on the device
        self._metrics: dict[str, Any] = {}  # key -> this rank's `_ResultMetric`
        self._last: dict[str, Tensor] = {}  # key -> the last step value written
        self._epoch_keys: set[str] = set()  # logged on this rank this epoch, in micro-batches with data
        self._warned: set[str] = set()
        self._clear()

    def _clear(self) -> None:
        """Forget the step: its calls, per micro-batch of an aggregation window."""
        self._calls: dict[str, Call] = {}
        self._own: dict[str, Tensor] = {}  # key -> this rank's value of its last call in the step
        self._window: list[dict[str, Call]] = []  # the window's earlier micro-batches with data
        self._before: dict[str, Any] = {}  # key -> epoch state before this micro-batch's first call
        self._in_flight: list[tuple[ReductionPlan, list[Any], Tensor]] = []
        self._started = self._backward_began = self._without_data = False

    def abstain_this_step(self) -> None:
        """This rank has no data in this micro-batch (``uneven_inputs="join"``): what it logs counts nowhere."""
        self._without_data = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        self._data_parallel = data_parallel(trainer.strategy)  # its ranks read different samples
        if self._data_parallel.size < 2:
            return
        self._device = trainer.strategy.root_device
        self._readers = (reading_interval(trainer), bool(trainer.loggers), trainer.log_every_n_steps)
        self._results = _results.training_results(trainer)
        take = partial(takes_over, warned=self._warned)
        self._changes.apply(Change.TRAINING_LOGS, _results.intercept_training_logs(self._results, take, self._taken))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()  # a batch skipped by `on_train_batch_start` returning -1 stays out of the next epoch
        self._epoch_keys.clear()
        self._unread, self._stale, self._after_unread = None, {}, False
        self._bar_total = bar_total(trainer)  # as the bar reads it in its own epoch start, after this callback's

    def _taken(self, logged: _results.LoggedValue) -> None:
        log, late = logged.log, self._backward_began
        reduction = logged.reduce_fx if log.sync_dist and logged.reduce_fx != "mean" else "mean"
        size = _results.batch_size_of_current_batch(self._results) if log.batch_size is None else log.batch_size
        self._calls[log.key] = Call(logged.value, 1.0 if size is None else float(size), reduction, late)
        self._own[log.key] = logged.value
        self._metrics[log.key] = logged.metric
        if logged.epoch_state_before is not None:
            self._before.setdefault(log.key, logged.epoch_state_before)
        self._latest[log.key] = (reduction, late, f"`{log.name}` (from {log.fx})")
        entry = None if self._layout is None else self._layout.get(log.key)
        if entry is None or entry[0] != reduction or (late and not entry[1]):
            self._unplaced = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # the step's values logged so far are complete: start their reduction, to run while backward computes
        if self._changes.active and not self._backward_began and _results.logs_this_step(trainer):
            self._backward_began = True  # in the last micro-batch of an aggregation window: what follows is late
            if self._layout is not None and self._needs_early() and self._read(trainer):
                self._start("early")

    def _read(self, trainer: pl.Trainer) -> bool:
        """Whether something reads this optimizer step's values (the same answer on every rank): see step_readers."""
        return reads_this_step(trainer, *self._readers[:2], self._bar_total)

    def _needs_early(self) -> bool:
        """Whether a reduction starts when backward begins: for names logged before it, or as the step's one."""
        return bool(self._plans["early"].entries) or not self._plans["late"].entries

    def _start(self, phase: str) -> None:
        """Start reducing this step's calls in ``phase``'s plan (every rank, in the same order)."""
        plan, self._started = self._plans[phase + "+stale" * self._after_unread], True
        calls = self._window + ([] if self._without_data else [self._calls])
        stale = {} if self._without_data or not self._after_unread else self._stale  # a rank without data adds none
        calls += [{STALE + key: call} for key, latest in stale.items() for call in latest]
        placed = [
            (key, call) for micro_batch in calls for key, call in micro_batch.items()
            if plan.entries.get(key) == call.reduction and (phase != "early" or not call.late)
        ]  # fmt: skip
        vector = plan.pack(placed, self._unplaced, self._device)
        self._unplaced = False
        self._in_flight.append((plan, *plan.start(vector, self._data_parallel.group)))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._changes.active:
            return
        if self._without_data:  # its values count nowhere: not in this rank's epoch values either
            for key, before in self._before.items():
                _results.set_epoch_state(self._metrics[key], *before)
        else:
            self._epoch_keys.update(self._calls)
        if not _results.logs_this_step(trainer):
            # inside an aggregation window: the previous step's values until the window is reduced
            for key in self._calls:
                _results.set_step_value(self._metrics[key], self._last.get(key))
            self._window += [] if self._without_data else [self._calls]
            self._calls, self._before, self._without_data = {}, {}, False
            return
        if self._layout is not None and not self._read(trainer):
            # nothing reads them: each rank's own stay (reduced if validation or the epoch end come before the next)
            self._unread = (self._calls, self._own, self._window, self._without_data)
            step = self._window + ([] if self._without_data else [self._calls])
            self._stale |= {key: [calls[key] for calls in step if key in calls] for key in set().union(*step)}
            self._last.update({} if self._without_data else self._own)
            self._after_unread = True
            self._clear()
            return
        self._unread = None
        where = f"epoch {trainer.current_epoch}, batch {batch_idx}"
        try:
            if self._layout is None:  # the first step: the names are agreed, then reduced in one collective
                self._agree(where)
                self._start("all")
            else:
                if not self._started and self._needs_early():  # no backward ran
                    self._start("early")
                if self._plans["late"].entries:
                    self._start("late")
            self._finish()
            if _results.loggers_read_this_step(trainer, logs=True) or _results.ends_epoch(trainer):
                self._check_and_reduce_again(where)
        finally:
            self._clear()
            self._stale, self._after_unread = {}, False

    def _check_and_reduce_again(self, where: str) -> None:
        """Where the host reads the values anyway: if a rank logged a name outside the layout, agree on the names
        anew and reduce the step again in the new layout."""
        if self._check_names(where):
            self._start("all")
            self._finish()

    def _reduce_unread(self, trainer: pl.Trainer, where: str) -> None:
        """Reduce the last optimizer step if nothing read it, where validation or the epoch end read its values."""
        if not self._changes.active or self._unread is None:
            return
        current = (self._calls, self._own, self._window, self._without_data, self._started)
        (self._calls, self._own, self._window, self._without_data), self._unread = self._unread, None
        self._start("all")
        self._finish()
        self._check_and_reduce_again(where)
        self._calls, self._own, self._window, self._without_data, self._started = current
        self._stale, self._after_unread = {}, False
        _results.publish_step_values(trainer, self._results)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reduce_unread(trainer, f"the validation in epoch {trainer.current_epoch}")

    def _finish(self) -> None:
        """Wait for the reductions in flight and write their values as the step values."""
        in_flight, self._in_flight = self._in_flight, []
        for plan, works, vector in in_flight:
            flags, values, calls = plan.finish(works, vector)
            self._flags = flags if self._flags is None else self._flags + flags
            self._write(plan, values, calls)

    def _write(self, plan: ReductionPlan, values: Tensor, calls: Tensor) -> None:
        """The reduced values as the step values (new device tensors), where some rank logged them, for the names
        this rank logged in the step (with data or not) or earlier in the epoch."""
        converted: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        for key in plan.entries:
            metric = self._metrics.get(key)
            local = self._own.get(key, self._last.get(key) if key in self._epoch_keys else None)
            if metric is None or local is None:
                continue  # never logged here, or not in this epoch
            call = self._calls.get(key)
            if call is not None and (call.reduction != plan.entries[key] or call.late and not self._layout[key][1]):
                continue  # reduced another way, or logged again after its reduction started: its own value until the
                # names are agreed
            on = (local.dtype, local.device)
            if (vector := converted.get(on)) is None:
                vector = converted[on] = values.to(dtype=local.dtype, device=local.device)
            own = call is not None and not self._without_data  # its own value is in the reduction
            step = _step_value(local, vector, calls, plan.position[key], plan.position.get(STALE + key), own)
            self._last[key] = step.reshape(local.shape)
            _results.set_step_value(metric, self._last[key])

    def _check_names(self, where: str) -> bool:
        """Every rank, at the same step: read the summed slot 0 since the last check (one host read); if a rank
        logged a name outside the layout, agree on the names anew (True)."""
        flags, self._flags = self._flags, None
        return flags is not None and bool(flags.item()) and self._agree(where)

    def _agree(self, where: str) -> bool:
        """Every rank: the names logged since the last agreement join the layout; a name reduced differently on
        different ranks raises :class:`MetricMismatchError`."""
        gathered: list[Any] = [None] * self._data_parallel.size
        dist.all_gather_object(gathered, (self._latest, self._readers), group=self._data_parallel.group)
        if len({readers for _, readers in gathered}) > 1:  # Trainers configured differently per rank: every step
            self._readers = (1, False, 0)
        gathered = [latest for latest, _ in gathered]
        reductions: dict[str, set[str]] = {}
        for key, (reduction, _, _) in (item for latest in gathered for item in latest.items()):
            reductions.setdefault(key, set()).add(reduction)
        if conflicts := {key for key, found in reductions.items() if len(found) > 1}:
            per_rank = [[(k, r, label) for k, (r, _, label) in latest.items() if k in conflicts] for latest in gathered]
            raise MetricMismatchError(describe_mismatch(per_rank, where))
        layout = dict(self._layout or {})
        for key, (reduction, late, _) in (item for latest in gathered for item in latest.items()):
            layout[key] = (reduction, late or layout.get(key) == (reduction, True))  # once late, late
        self._layout, self._latest, self._unplaced = layout, {}, False
        self._plans = {}
        for phase, lates in {"early": (False,), "late": (True,), "all": (False, True)}.items():
            entries = {k: r for k, (r, late) in layout.items() if late in lates}
            self._plans[phase] = ReductionPlan(entries, self._device)
            with_stale = entries | {STALE + key: reduction for key, reduction in entries.items()}
            self._plans[phase + "+stale"] = ReductionPlan(with_stale, self._device)
        return True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._changes.active:
            return
        self._reduce_unread(trainer, f"the end of epoch {trainer.current_epoch}")
        self._check_names(f"the end of epoch {trainer.current_epoch}")
        local = {key: self._metrics[key] for key in sorted(self._epoch_keys) if self._metrics[key].meta.on_epoch}
        # each name's reduction over the ranks as this rank last logged it (a name not yet agreed included)
        reductions = {key: reduction for key, (reduction, _) in (self._layout or {}).items()}
        reductions |= {key: reduction for key, (reduction, _, _) in self._latest.items()}
        notes = {key: {"over_ranks": reductions.get(key, "mean")} for key in local}
        combine, synced = epoch_values.combine_training, _results.synced_by_shardplus
        epoch_values.reduce_epoch_values(trainer, pl_module, self._results, local, combine, synced, notes)

    def _stop(self, *_: Any, **__: Any) -> None:
        self._changes.undo()
        self._reset()

    on_train_end = on_exception = teardown = _stop


# The name to import. The class's own name is private so that the `shardplus` command (jsonargparse) does not
# offer it among the callbacks to add: the strategy adds it where it applies.
AverageTrainingMetrics = _AverageTrainingMetrics
