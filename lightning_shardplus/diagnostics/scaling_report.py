"""The :class:`ScalingReport` callback: where each training micro-batch's time goes, marked at Lightning's hooks
on a step clock, summed per rank during the fit and gathered once when training ends."""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardplus._compat.lightning import TRAIN_DATALOADER_NEXT
from lightning_shardplus._compat.torch import call_when_backward_ends
from lightning_shardplus.data.aggregation import micro_batch_size, micro_batches_per_step
from lightning_shardplus.diagnostics.scaling_summary import (
    STEP_PHASES,
    format_scaling_report,
    loggable_figures,
    summarize_scaling,
)
from lightning_shardplus.diagnostics.step_clock import HostClock, StepClock, step_clock
from lightning_shardplus.validation import check_bool, check_int

_TOTALS = (*STEP_PHASES, "samples", "micro_batches")


class ScalingReport(Callback):
    """Where each training step's time goes (:data:`STEP_PHASES`, marked at Lightning's hooks), summed per rank and
    gathered once when training ends; rank 0 then prints a verdict, logs ``scaling/*`` to the Trainer's loggers and
    writes ``output_file``; every rank keeps :attr:`report`. The arguments and each phase: docs/scaling-report.md."""

    def __init__(
        self,
        single_device_samples_per_second: float | None = None,
        skip_first_steps: int = 2,
        threshold: float = 0.2,
        output_file: str | os.PathLike | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        verbose: bool = True,
        device_timing: bool | None = None,
    ) -> None:
        if single_device_samples_per_second is not None and not single_device_samples_per_second > 0:
            raise ValueError(
                f"`single_device_samples_per_second`={single_device_samples_per_second!r} is not valid: "
                "expected a number > 0."
            )
        skip_first_steps = check_int("skip_first_steps", skip_first_steps, minimum=0)
        if not 0 < threshold < 1:
            raise ValueError(f"`threshold`={threshold!r} is not valid: expected a number in (0, 1).")
        check_bool("verbose", verbose)
        if device_timing is not None and not isinstance(device_timing, bool):
            raise TypeError(f"`device_timing`={device_timing!r} is not valid: expected None, True or False.")
        self.single_device_samples_per_second, self.threshold = single_device_samples_per_second, threshold
        self.skip_first_steps, self.batch_size_fn = skip_first_steps, batch_size_fn
        self.verbose, self.device_timing = verbose, device_timing
        self.output_file = None if output_file is None else Path(output_file)
        self.report: dict[str, Any] | None = None
        self._sums = [0.0] * len(_TOTALS)  # per `_TOTALS` key, summed locally
        self._seen, self._was_tuning, self._world_size = 0, False, 1
        self._batch_size: int | None = None
        self._clock: StepClock = HostClock()
        self._previous_end: Any = None  # a mark of `_clock`
        self._reset_marks()
        self._pending: deque[_CountedStep] = deque()  # counted micro-batches whose marks the clock has not passed
        self._fetches: list[tuple[Any, Any]] = []  # (start, stop) marks of `next()` on the loader since the last end
        self._fetch_started: Any = None
        self._profiler: _FetchTimingProfiler | None = None

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the Trainer's callbacks
        # device events cannot be pickled; `setup` picks the clock again in the new process
        fresh = {"_clock": HostClock(), "_fetches": [], "_pending": deque()}
        marks = dict.fromkeys(("_start", "_before_backward", "_computed", "_after_backward"))
        return self.__dict__ | fresh | marks | {"_profiler": None, "_fetch_started": None, "_previous_end": None}

    def _reset_marks(self) -> None:
        """Forget the micro-batch's marks (None: not reached) and the host times that place the end of the backward
        computation."""
        self._start = self._before_backward = self._computed = self._after_backward = None
        self._host_before_backward = self._host_computed = self._host_after_backward = math.nan

    def _backward_started(self, grad: torch.Tensor) -> None:
        """A hook on the loss: backward has started; the mark is queued to run when its computation ends."""
        call_when_backward_ends(self._mark_computed)

    def _mark_computed(self) -> None:
        """Every gradient of the pass is computed (what is left of ``backward()`` is DDP's wait)."""
        self._host_computed = time.perf_counter()
        self._computed = self._clock.mark()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._clock = step_clock(trainer.strategy.root_device, self.device_timing)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sums, self._seen, self._was_tuning, self.report = [0.0] * len(_TOTALS), 0, False, None
        self._world_size, self._batch_size = trainer.world_size, micro_batch_size(trainer)
        self._pending.clear()
        if not isinstance(trainer.profiler, _FetchTimingProfiler):
            self._profiler = _FetchTimingProfiler(trainer.profiler, self)
            # an instance patch: no hook sees `next()` on the training loader, Lightning times it only through the
            # (public) profiler; the user's profiler is wrapped, not replaced, and put back when training ends
            trainer.profiler = self._profiler

    def _restore_profiler(self, trainer: pl.Trainer) -> None:
        if self._profiler is not None and trainer.profiler is self._profiler:
            trainer.profiler = self._profiler.wrapped
        self._profiler = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_profiler(trainer)

    on_exception = teardown  # (trainer, pl_module, exception)

    def _fetch_start(self) -> None:
        self._fetch_started = self._clock.mark()

    def _fetch_stop(self) -> None:
        if self._fetch_started is not None:
            self._fetches.append((self._fetch_started, self._clock.mark()))
            self._fetch_started = None

    def _new_gap(self) -> None:
        """The time between micro-batches starts again now (the start of an epoch, the end of validation)."""
        self._previous_end = self._clock.mark()
        self._fetches = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._new_gap()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._new_gap()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._reset_marks()
        self._start = self._clock.mark()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._before_backward is None:
            self._host_before_backward = time.perf_counter()
            self._before_backward = self._clock.mark()
        if self._world_size > 1 and loss.requires_grad:  # with one rank there is nothing to exchange
            loss.register_hook(self._backward_started)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._host_after_backward = time.perf_counter()
        self._after_backward = self._clock.mark()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = self._clock.mark()
        previous_end, self._previous_end = self._previous_end, end
        fetches, self._fetches = self._fetches, []
        self._seen += 1
        # tensor-fusion autotuning re-wraps DDP and tries slower bucket sizes on purpose: its steps, and the first
        # step after it (the last re-wrap, DDP's bucket rebuild), are not this run's steady state
        tuning = bool(getattr(trainer.strategy, "fusion_tuning", False))
        after_tuning, self._was_tuning = self._was_tuning, tuning
        if tuning or after_tuning or self._seen <= self.skip_first_steps or self._start is None:
            return self._count_finished(wait=False)
        computed = self._computed if self._world_size > 1 and self._computed_in_backward() else None
        samples = self.batch_size_fn(batch) if self.batch_size_fn is not None else (self._batch_size or 0)
        start = self._start if previous_end is None else previous_end
        self._pending.append(_CountedStep(start, fetches, self._start, self._before_backward, computed,
                                          self._after_backward, end, samples))  # fmt: skip
        self._count_finished(wait=False)  # on the host clock: at once

    def _computed_in_backward(self) -> bool:
        """Whether the backward computation ended during this backward pass, by the host's clock (NaN: not made)."""
        before, computed = self._host_before_backward, self._host_computed
        return (before <= computed or math.isnan(before)) and computed <= self._host_after_backward

    def _count_finished(self, wait: bool) -> None:
        """Adds the phases of the pending micro-batches the clock can measure (with ``wait``: all of them)."""
        clock, sums = self._clock, self._sums
        while self._pending:
            step = self._pending[0]
            if wait:
                clock.wait(step.end)
            elif not all(clock.ready(mark) for mark in step.all_marks()):
                return
            self._pending.popleft()
            for i, seconds in enumerate(step.phases(clock)):
                if seconds > 0.0:
                    sums[i] += seconds
            sums[-2] += step.samples
            sums[-1] += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_profiler(trainer)
        self._count_finished(wait=True)
        local = torch.tensor(self._sums, dtype=torch.float64, device=pl_module.device)
        gathered = [local]
        if dist.is_available() and dist.is_initialized():  # the one collective of this callback
            # (not `strategy.all_gather`: Lightning's goes through torch's deprecated autograd all_gather)
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        per_rank = [[float(value) for value in row] for row in torch.stack(gathered).cpu()]
        compression = getattr(getattr(trainer.strategy, "config", None), "gradient_compression", None)
        self.report = summarize_scaling(
            [dict(zip(_TOTALS, row, strict=True)) for row in per_rank], threshold=self.threshold,
            single_device_samples_per_second=self.single_device_samples_per_second,
            micro_batches_per_step=micro_batches_per_step(trainer), timing=self._clock.name,
            gradient_compression=compression,
        )  # fmt: skip
        if not trainer.is_global_zero:
            return
        if self.verbose:
            rank_zero_info(f"ScalingReport: {self.report['verdict']}\n{format_scaling_report(self.report)}")
        if self.output_file is not None:
            self.output_file.parent.mkdir(parents=True, exist_ok=True)
            self.output_file.write_text(json.dumps(self.report, indent=2))
        if not self.report["micro_batches"]:
            return
        metrics = {f"scaling/{key}": value for key, value in loggable_figures(self.report).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


@dataclass
class _CountedStep:
    """A counted micro-batch: its clock marks in the order they happen (None: not reached) and its samples."""

    previous_end: Any
    fetches: list[tuple[Any, Any]]
    start: Any
    before_backward: Any
    computed: Any
    after_backward: Any
    end: Any
    samples: int

    def all_marks(self) -> list[Any]:
        marks = [self.previous_end, self.start, self.before_backward, self.computed, self.after_backward, self.end]
        return [mark for mark in marks if mark is not None] + [mark for pair in self.fetches for mark in pair]

    def phases(self, clock: StepClock) -> tuple[float, ...]:
        """Seconds per phase of :data:`STEP_PHASES` on ``clock`` (all marks passed)."""
        fetch_seconds = sum(clock.seconds(start, stop) for start, stop in self.fetches)
        end = self.end
        before_backward = end if self.before_backward is None else self.before_backward
        after_backward = before_backward if self.after_backward is None else self.after_backward
        computed = after_backward if self.computed is None else self.computed
        gap = clock.seconds(self.previous_end, self.start)
        fetch = min(fetch_seconds, gap if gap > 0.0 else 0.0)
        return (
            fetch,
            gap - fetch,
            clock.seconds(self.start, before_backward),
            clock.seconds(before_backward, computed),
            clock.seconds(computed, after_backward),
            clock.seconds(after_backward, end),
        )


class _FetchTimingProfiler(Profiler):
    """``trainer.profiler`` during training with a :class:`ScalingReport`: times the training batch fetch for the
    report and passes every action on to the profiler it wraps."""

    def __init__(self, wrapped: Profiler, report: ScalingReport) -> None:
        super().__init__()
        self.wrapped, self.report = wrapped, report

    def profile(self, action_name: str) -> Any:
        """The wrapped profiler's own ``profile`` for every action but the batch fetch: the ~40 actions profiled per
        step cost what they cost without this wrapper."""
        if action_name == TRAIN_DATALOADER_NEXT:
            return super().profile(action_name)
        return self.wrapped.profile(action_name)

    def start(self, action_name: str) -> None:
        if action_name == TRAIN_DATALOADER_NEXT:
            self.report._fetch_start()
        self.wrapped.start(action_name)

    def stop(self, action_name: str) -> None:
        self.wrapped.stop(action_name)
        if action_name == TRAIN_DATALOADER_NEXT:
            self.report._fetch_stop()

    def summary(self) -> str:
        return self.wrapped.summary()
