"""Lightning callbacks: checks and reports that run beside training."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_shardplus import aggregation
from lightning_shardplus._lightning import TRAIN_DATALOADER_NEXT, call_when_backward_ends
from lightning_shardplus._validation import check_bool, check_choice, check_int
from lightning_shardplus.aggregation import effective_batch_size, micro_batch_size
from lightning_shardplus.sharding import (
    DIGEST_WIDTH,
    PaddedShardSampler,
    ShardingError,
    check_epoch_shards,
    digest_problem,
    shard_digest,
)
from lightning_shardplus.step_clock import HostClock, StepClock, step_clock

_dataloaders = aggregation.dataloaders


class VerifySharding(Callback):
    """At the end of each training epoch, check across ranks that the shards were disjoint, each rank read its own
    positions of the epoch's order and, if the epoch ran to its end, covered every sample left in it. Added by
    ``ShardPlusStrategy(verify_sharding=True)``.

    Each rank sends a fixed-size digest (:func:`~lightning_shardplus.sharding.shard_digest`: counts and keyed
    hash sums), all samplers in one all-reduce, whatever the dataset's length. Only when the digests disagree are
    the index lists gathered, to name the ranks and a sample."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        samplers = [
            dl.sampler
            for dl in _dataloaders(trainer.train_dataloader)
            if isinstance(dl.sampler, PaddedShardSampler)
        ]
        if not samplers:
            return
        distributed = dist.is_available() and dist.is_initialized()
        # the process group's rank: the one a rank should have read for, whatever its sampler was told
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        own = [shard_digest(sampler, rank, world) for sampler in samplers]
        total = torch.tensor([value for digest in own for value in digest], dtype=torch.int64, device=pl_module.device)
        if distributed:
            dist.all_reduce(total)
        totals = total.tolist()
        for i, sampler in enumerate(samplers):
            problem = digest_problem(totals[i * DIGEST_WIDTH : (i + 1) * DIGEST_WIDTH], own[i], sampler, world)
            if problem is not None:
                _name_the_ranks(trainer.current_epoch, sampler, world, distributed, problem)


def _name_the_ranks(epoch: int, sampler: PaddedShardSampler, world: int, distributed: bool, problem: str) -> None:
    """The second pass, after the digests disagreed (every rank takes it): gather the index lists to name the
    ranks and a sample (:func:`~lightning_shardplus.sharding.check_epoch_shards`), else raise the digest's
    finding."""
    local = (sampler.yielded_indices[: sampler.num_real_samples], sampler.completed_epoch)
    gathered: list[Any] = [None] * world
    if distributed:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    check_epoch_shards(
        epoch,
        [indices for indices, _ in gathered],
        sampler.dataset_length,
        # a resumed epoch read only what the checkpoint had left
        expect_full_coverage=all(done for _, done in gathered)
        and not sampler.drop_last
        and sampler.start_position == 0,
    )
    raise ShardingError(f"verify_sharding: in epoch {epoch}, {problem}.")


ScalingRule = Literal["linear", "sqrt", "none"]
SCALING_RULES: tuple[str, ...] = ("linear", "sqrt", "none")


def scaling_factor(rule: str, batch_ratio: float) -> float:
    """The learning-rate multiplier of ``rule`` for ``batch_ratio = effective batch / reference batch``:
    ``batch_ratio`` (linear), ``sqrt(batch_ratio)`` (sqrt) or 1 (none)."""
    check_choice("rule", rule, SCALING_RULES)
    if rule == "linear":
        return float(batch_ratio)
    if rule == "sqrt":
        return math.sqrt(batch_ratio)
    return 1.0


def warmup_factor(factor: float, step: int, warmup_steps: int) -> float:
    """``factor`` reached linearly over ``warmup_steps`` optimizer steps: 1 at step 0, ``factor`` from step
    ``warmup_steps`` on (steps counted from 0)."""
    if step >= warmup_steps:
        return factor
    return 1.0 + (factor - 1.0) * step / warmup_steps


def _check_warmup_epochs(value: Any) -> None:
    message = f"`warmup_epochs`={value!r} is not valid: expected a finite number >= 0 (fractions allowed)."
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(message)
    if not value >= 0 or math.isinf(value):  # `not >=` also rejects NaN
        raise ValueError(message)


def _aggregation(trainer: pl.Trainer) -> int:
    """Micro-batches per optimizer step: the strategy's ``aggregation_frequency`` or Lightning's
    ``accumulate_grad_batches`` (ShardPlusStrategy sets the latter to the former: they are one count, never
    multiplied)."""
    return aggregation.micro_batches_per_step(trainer)


_per_device_batch_size = aggregation.micro_batch_size


class ScaleLearningRate(Callback):
    """Scale the learning rate with the global batch size, after an optional linear warmup: the large-batch
    recipe of Goyal et al. (2017), as Horovod and Determined apply it.

    The factor is ``rule(effective_batch / reference_batch_size)`` with ``rule`` linear (the ratio), sqrt
    (its square root) or none (1), and::

        effective_batch = per_device_batch * world_size * aggregation
        aggregation     = micro-batches per optimizer step: the strategy's aggregation_frequency, or
                          trainer.accumulate_grad_batches (ShardPlusStrategy makes them the same count)

    which is the figure ``ShardPlusStrategy.effective_batch_size`` reports (both use
    :func:`lightning_shardplus.aggregation.effective_batch_size`). ``per_device_batch`` is the datamodule's
    ``per_device_batch_size`` (``ShardPlusDataModule``), else the training DataLoader's ``batch_size``. By
    default ``reference_batch_size`` is the per-device batch, i.e. the learning rates in the optimizer were
    tuned on one device without accumulation: the ratio is then ``world_size * aggregation``.

    During the first ``warmup_steps`` optimizer steps the factor goes linearly from 1 (step 0) to its full
    value (reached at step ``warmup_steps``); ``warmup_epochs`` (fractions allowed) is converted to optimizer
    steps with ``ceil(trainer.num_training_batches / aggregation)`` steps per epoch, rounded to the nearest
    step.

    The factor *multiplies* whatever learning rate the optimizer holds (yours, your schedulers'): it is
    applied to every parameter group only while the optimizer's ``step`` runs (torch optimizer step pre/post
    hooks) and the original values are put back right after, before Lightning steps the LR schedulers. So
    chainable schedulers (StepLR, ReduceLROnPlateau, ...) keep seeing their own values,
    ``LearningRateMonitor`` shows the unscaled schedule, and checkpoints hold unscaled rates; the callback's
    own state (optimizer steps taken) is checkpointed, so a resumed run continues the warmup where it stopped
    and never scales twice.

    The rate actually applied is logged as ``lr-scaled/group{i}`` (``lr-scaled/optimizer{k}/group{i}`` with
    several optimizers) on every step that stepped the optimizer.

    Args:
        rule: ``"linear"``, ``"sqrt"`` or ``"none"`` (no scaling; the warmup then has nothing to ramp).
        reference_batch_size: the batch size (samples per optimizer step) the learning rate was tuned for;
            None: the per-device batch size.
        warmup_steps: optimizer steps of linear warmup, ``>= 0``.
        warmup_epochs: the same in epochs (a float, ``>= 0``); give at most one of the two.
        log_lr: log the applied learning rate of every parameter group.
    """

    def __init__(
        self,
        rule: ScalingRule = "linear",
        reference_batch_size: int | None = None,
        warmup_steps: int | None = None,
        warmup_epochs: float | None = None,
        log_lr: bool = True,
    ) -> None:
        check_choice("rule", rule, SCALING_RULES)
        if reference_batch_size is not None:
            reference_batch_size = check_int("reference_batch_size", reference_batch_size, minimum=1)
        if warmup_steps is not None and warmup_epochs is not None:
            raise ValueError(
                f"`warmup_steps`={warmup_steps!r} and `warmup_epochs`={warmup_epochs!r} were both given: "
                "give at most one of them."
            )
        if warmup_steps is not None:
            warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        if warmup_epochs is not None:
            _check_warmup_epochs(warmup_epochs)
        check_bool("log_lr", log_lr)
        self.rule: ScalingRule = rule
        self.reference_batch_size = reference_batch_size
        self.warmup_steps = warmup_steps
        self.warmup_epochs = warmup_epochs
        self.log_lr = log_lr
        # Resolved when training starts.
        self.effective_batch_size: int | None = None
        self.factor = 1.0
        self.resolved_warmup_steps = 0
        self._steps: list[int] = []  # optimizer steps taken, per optimizer
        self._restored_steps: list[int] | None = None
        self._optimizers: list[Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._user_lrs: dict[int, list[Any]] = {}  # optimizer index -> its rates, while its step runs
        self._applied: dict[int, list[Any]] = {}  # optimizer index -> rates of its last step
        self._depth: list[int] = []  # nested step calls per optimizer (a subclass calling super().step())
        self._log_pending = False

    def factor_at(self, step: int) -> float:
        """The multiplier applied at optimizer step ``step`` (counted from 0)."""
        return warmup_factor(self.factor, step, self.resolved_warmup_steps)

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restored_steps = None  # a checkpoint's state, if any, is loaded after this hook

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        aggregation_steps = _aggregation(trainer)
        world_size = trainer.world_size
        self.effective_batch_size = effective_batch_size(trainer)
        if self.reference_batch_size is None:
            ratio = float(world_size * aggregation_steps)
        elif self.effective_batch_size is None:
            raise ValueError(
                f"ScaleLearningRate got `reference_batch_size`={self.reference_batch_size} but cannot find "
                "the per-device batch size: the datamodule has no `per_device_batch_size` and no training "
                "DataLoader has a `batch_size`. Give the DataLoader a batch_size, or leave "
                "`reference_batch_size` None."
            )
        else:
            ratio = self.effective_batch_size / self.reference_batch_size
        self.factor = scaling_factor(self.rule, ratio)
        self.resolved_warmup_steps = self._resolve_warmup_steps(trainer, aggregation_steps)

        self._remove_hooks()
        self._optimizers = list(trainer.optimizers)
        restored = self._restored_steps
        if restored is not None and len(restored) == len(self._optimizers):
            self._steps = list(restored)
        else:  # a fresh run, or a checkpoint without this callback's state
            self._steps = [trainer.global_step] * len(self._optimizers)
        self._depth = [0] * len(self._optimizers)
        for index, optimizer in enumerate(self._optimizers):
            self._handles.append(optimizer.register_step_pre_hook(self._make_pre_hook(index)))
            self._handles.append(optimizer.register_step_post_hook(self._make_post_hook(index)))

        batch = "unknown" if self.effective_batch_size is None else self.effective_batch_size
        reference = self.reference_batch_size or "the per-device batch"
        rank_zero_info(
            f"ScaleLearningRate: effective batch {batch} ({world_size} processes x {aggregation_steps} "
            f"aggregated micro-batches), reference {reference}: {self.rule} factor {self.factor:g}, warmup "
            f"{self.resolved_warmup_steps} optimizer steps, starting at step {min(self._steps, default=0)}"
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (self.log_lr and self._log_pending):
            return
        self._log_pending = False
        several = len(self._optimizers) > 1
        for index, rates in self._applied.items():
            for group, rate in enumerate(rates):
                name = f"lr-scaled/optimizer{index}/group{group}" if several else f"lr-scaled/group{group}"
                # the same on every rank: nothing to average (and averaged metrics would warn, this is logged late)
                pl_module.log(name, rate, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_all()
        self._remove_hooks()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_all()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_all()
        self._remove_hooks()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A checkpoint written while a step runs (e.g. from inside the closure) still gets the unscaled rates.
        states = checkpoint.get("optimizer_states")
        for index, rates in self._user_lrs.items():
            if states is None or index >= len(states):
                continue
            for group, rate in zip(states[index]["param_groups"], rates, strict=False):
                group["lr"] = rate.clone() if isinstance(rate, torch.Tensor) else rate

    def state_dict(self) -> dict[str, Any]:
        steps = self._steps if self._steps else (self._restored_steps or [])
        return {
            "steps": list(steps),
            "rule": self.rule,
            "factor": self.factor,
            "warmup_steps": self.resolved_warmup_steps,
            "reference_batch_size": self.reference_batch_size,
            "effective_batch_size": self.effective_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        steps = state_dict.get("steps")
        self._restored_steps = [int(step) for step in steps] if steps else None

    # ------------------------------------------------------------------ internals

    def _resolve_warmup_steps(self, trainer: pl.Trainer, micro_batches: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if not self.warmup_epochs:
            return 0
        batches = trainer.num_training_batches
        if math.isinf(batches):
            raise ValueError(
                f"`warmup_epochs`={self.warmup_epochs!r} needs the number of training batches per epoch, but "
                "the training dataloader has no length: give `warmup_steps` instead."
            )
        steps_per_epoch = math.ceil(batches / micro_batches)
        return math.floor(self.warmup_epochs * steps_per_epoch + 0.5)

    def _make_pre_hook(self, index: int) -> Any:
        def scale(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            # torch runs the hooks again in every overridden `step` of a subclass chain: scale only once.
            self._depth[index] += 1
            if self._depth[index] > 1:
                return
            factor = self.factor_at(self._steps[index])
            saved: list[Any] = []
            applied: list[Any] = []
            for group in optimizer.param_groups:
                rate = group["lr"]
                if isinstance(rate, torch.Tensor):
                    saved.append(rate.clone())
                    rate.mul_(factor)
                    applied.append(rate.detach().clone())
                else:
                    saved.append(rate)
                    group["lr"] = rate * factor
                    applied.append(rate * factor)
            self._user_lrs[index] = saved
            self._applied[index] = applied

        return scale

    def _make_post_hook(self, index: int) -> Any:
        def restore(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            self._depth[index] -= 1
            if self._depth[index] > 0:
                return
            self._restore(index)
            self._steps[index] += 1
            self._log_pending = True

        return restore

    def _restore(self, index: int) -> None:
        rates = self._user_lrs.pop(index, None)
        if rates is None:
            return
        for group, rate in zip(self._optimizers[index].param_groups, rates, strict=False):
            if isinstance(rate, torch.Tensor) and isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(rate)
            else:
                group["lr"] = rate

    def _restore_all(self) -> None:
        for index in list(self._user_lrs):
            self._restore(index)
        self._depth = [0] * len(self._optimizers)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------- scaling report

STEP_PHASES: tuple[str, ...] = ("data", "between_steps", "forward", "backward", "communication", "optimizer")
_TOTALS = (*STEP_PHASES, "samples", "micro_batches")


class ScalingReport(Callback):
    """Where each training step's time goes, summed over the fit and aggregated across ranks, with a verdict.

    Each training micro-batch is cut into six phases by the wall clock of this process, at Lightning's hooks:

    - ``data``: waiting for the next batch: ``next()`` on the training loader (workers, ``__getitem__``,
      collate), timed at the point where Lightning profiles it (``train_dataloader_next``, through
      ``trainer.profiler``, which this callback wraps during training and hands to your profiler unchanged);
    - ``between_steps``: the rest of the time from the end of the previous micro-batch (``on_train_batch_end``;
      the start of the epoch, or the end of validation) to ``on_train_batch_start``: moving the batch to the
      device, Lightning's per-step broadcast of the SIGTERM flag (a collective: waiting for a slower rank shows
      here), logging, checkpointing, callbacks. Validation is not counted;
    - ``forward``: ``on_train_batch_start`` to ``on_before_backward`` (``training_step``, the loss);
    - ``backward``: ``on_before_backward`` to the end of the backward computation: the moment the autograd
      engine has computed every gradient (DDP has handed its last bucket to its all-reduce or communication
      hook), marked by a callback the engine runs at the end of the pass, queued when backward starts (from a
      hook on the loss) so that it runs before DDP's own, which waits for the all-reduces;
    - ``communication``: exposed gradient communication, from that moment to ``on_after_backward``, when
      ``backward()`` has returned: DDP has waited for every bucket's all-reduce and written the gradients back.
      What overlapped the backward computation is not in it. Zero with 1 rank (nothing to exchange); a few
      microseconds in micro-batches that do not communicate (aggregation). DDP keeps its built-in all-reduce
      (no Python communication hook is needed), under ``ShardPlusStrategy`` or any other;
    - ``optimizer``: ``on_after_backward`` to ``on_train_batch_end`` (gradient clipping, ``optimizer.step``,
      ``zero_grad``, Lightning's step logging).

    The first ``skip_first_steps`` micro-batches (worker start, DDP's bucket rebuild) are not counted, nor the
    steps of tensor-fusion autotuning (``auto_tune_tensor_fusion``) and the one after it. Each rank
    sums locally; one ``all_gather`` of nine numbers when training ends combines them, so the callback is
    cheap enough to leave on (the benchmark's ``shardplus-report`` row measures it). Samples/s is the samples of
    all ranks over the slowest rank's counted time; with ``single_device_samples_per_second`` (one device's
    figure for the same model and per-device batch) the scaling efficiency is ``samples/s / (world size x
    baseline)``.

    On the CPU the marks are the host's wall clock. On an accelerator with timing events (CUDA, ROCm, XPU), where
    kernels run asynchronously and the host runs ahead, each mark is also an event recorded on the device's
    current stream and the phases are the *device's* time between them (``device_timing``): forward, backward and
    the optimizer are the device's work; exposed communication is the device waiting, after the backward
    computation ended, for the all-reduces still running and a communication hook's follow-up work (e.g.
    decompression) and copying the gradients back; data is the device's time across each ``next()`` on the
    loader (idle, if it ran out of work while the host waited for data), the rest of the gap between two
    micro-batches is between steps. Events are read once the device has passed them (``query``), a few steps
    later, so the report never makes the host wait for the device during training.
    ``report["timing"]`` says which clock was used. For rolling throughput and FLOPs during training use
    Lightning's ``ThroughputMonitor`` beside it; this report gives the whole fit's verdict.

    When training ends, rank 0 prints the verdict (``rank_zero_info``), logs ``scaling/*`` figures to every
    logger of the Trainer, and writes the report as JSON to ``output_file`` if given; every rank keeps it in
    :attr:`report`.

    Args:
        single_device_samples_per_second: samples/s of the same workload on one device, for the efficiency.
        skip_first_steps: micro-batches at the start of the fit that are not counted.
        threshold: the share of a step from which data loading, exposed communication or the time between steps
            is called the bottleneck.
        output_file: a JSON file rank 0 writes the report to.
        batch_size_fn: samples in a batch; default: the datamodule's ``per_device_batch_size`` or the training
            DataLoader's ``batch_size``.
        verbose: print the verdict and the figures on rank 0 when training ends.
        device_timing: ``None``: device timing events where the training device has them, the host clock on the
            CPU; ``False``: always the host clock; ``True``: device events, an error on a device without them.
    """

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
        self.single_device_samples_per_second = single_device_samples_per_second
        self.skip_first_steps = skip_first_steps
        self.threshold = threshold
        self.output_file = None if output_file is None else Path(output_file)
        self.batch_size_fn = batch_size_fn
        check_bool("verbose", verbose)
        self.verbose = verbose
        if device_timing is not None and not isinstance(device_timing, bool):
            raise TypeError(f"`device_timing`={device_timing!r} is not valid: expected None, True or False.")
        self.device_timing = device_timing
        self.report: dict[str, Any] | None = None
        self._sums = [0.0] * len(_TOTALS)  # per `_TOTALS` key, summed locally: floats, nothing allocated per step
        self._seen = 0
        self._was_tuning = False
        self._world_size = 1
        self._batch_size: int | None = None
        self._clock: StepClock = HostClock()
        self._on_host = True  # `_clock` is the host's: marks are `perf_counter` floats, counted as they come
        self._previous_end: Any = None  # a mark of `_clock`
        self._reset_marks()
        self._pending: deque[_CountedStep] = deque()  # counted micro-batches whose marks the device has not passed
        # `next()` on the training loader since the previous micro-batch ended: its seconds on the host clock, its
        # (start, stop) marks on a device clock (read once the device has passed them)
        self._fetch_seconds = 0.0
        self._fetches: list[tuple[Any, Any]] = []
        self._fetch_started: Any = None
        self._profiler: _FetchTimingProfiler | None = None

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the Trainer's callbacks
        # device events cannot be pickled; `setup` picks the clock again in the new process
        fresh = {"_clock": HostClock(), "_on_host": True, "_fetches": [], "_pending": deque()}
        marks = dict.fromkeys(("_start", "_before_backward", "_computed", "_after_backward"))
        return self.__dict__ | fresh | marks | {"_profiler": None, "_fetch_started": None, "_previous_end": None}

    def _reset_marks(self) -> None:
        """Forget the micro-batch's marks of `_clock` (None: not reached) and the host times of the three that
        decide whether the backward computation ended during the backward pass."""
        self._start = self._before_backward = self._computed = self._after_backward = None
        self._host_before_backward = self._host_computed = self._host_after_backward = math.nan

    # ------------------------------------------------------------------ the end of the backward computation

    def _backward_started(self, grad: torch.Tensor) -> None:
        """A hook on the loss: backward has started; the mark is queued to run when its computation ends."""
        call_when_backward_ends(self._mark_computed)

    def _mark_computed(self) -> None:
        """Every gradient of the pass is computed (what is left of ``backward()`` is DDP's wait)."""
        self._host_computed = now = time.perf_counter()
        self._computed = now if self._on_host else self._clock.mark()

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._clock = step_clock(trainer.strategy.root_device, self.device_timing)
            self._on_host = isinstance(self._clock, HostClock)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sums = [0.0] * len(_TOTALS)
        self._seen = 0
        self._was_tuning = False
        self._world_size = trainer.world_size
        self._batch_size = micro_batch_size(trainer)
        self._pending.clear()
        self.report = None
        if not isinstance(trainer.profiler, _FetchTimingProfiler):
            self._profiler = _FetchTimingProfiler(trainer.profiler, self)
            trainer.profiler = self._profiler

    def _restore_profiler(self, trainer: pl.Trainer) -> None:
        if self._profiler is not None and trainer.profiler is self._profiler:
            trainer.profiler = self._profiler.wrapped
        self._profiler = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_profiler(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_profiler(trainer)

    def _fetch_start(self) -> None:
        self._fetch_started = time.perf_counter() if self._on_host else self._clock.mark()

    def _fetch_stop(self) -> None:
        if self._fetch_started is None:
            return
        if self._on_host:
            self._fetch_seconds += time.perf_counter() - self._fetch_started
        else:
            self._fetches.append((self._fetch_started, self._clock.mark()))
        self._fetch_started = None

    def _new_gap(self) -> None:
        """The time between micro-batches starts again now (the start of an epoch, the end of validation)."""
        self._previous_end = time.perf_counter() if self._on_host else self._clock.mark()
        self._fetch_seconds, self._fetches = 0.0, []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._new_gap()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._new_gap()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._reset_marks()
        self._start = time.perf_counter() if self._on_host else self._clock.mark()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._before_backward is None:
            self._host_before_backward = now = time.perf_counter()
            self._before_backward = now if self._on_host else self._clock.mark()
        if self._world_size > 1 and loss.requires_grad:  # with one rank there is nothing to exchange
            loss.register_hook(self._backward_started)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._host_after_backward = now = time.perf_counter()
        self._after_backward = now if self._on_host else self._clock.mark()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = time.perf_counter() if self._on_host else self._clock.mark()
        previous_end, self._previous_end = self._previous_end, end
        fetch_seconds, fetches, self._fetch_seconds, self._fetches = self._fetch_seconds, self._fetches, 0.0, []
        self._seen += 1
        # tensor-fusion autotuning re-wraps DDP and tries slower bucket sizes on purpose: its steps, and the first
        # step after it (the last re-wrap, DDP's bucket rebuild), are not this run's steady state
        tuning = bool(getattr(trainer.strategy, "fusion_tuning", False))
        after_tuning, self._was_tuning = self._was_tuning, tuning
        if tuning or after_tuning or self._seen <= self.skip_first_steps or self._start is None:
            return self._count_finished(wait=False)
        step = _CountedStep(
            self._start if previous_end is None else previous_end,
            fetches,
            self._start,
            self._before_backward,
            self._computed if self._world_size > 1 and self._computed_in_backward() else None,
            self._after_backward,
            end,
            self.batch_size_fn(batch) if self.batch_size_fn is not None else (self._batch_size or 0),
        )
        if self._on_host:  # every mark has happened: counted at once, without queueing
            return self._add(step.phases(self._clock, fetch_seconds), step.samples)
        self._pending.append(step)
        self._count_finished(wait=False)

    def _computed_in_backward(self) -> bool:
        """Whether the backward computation ended during this backward pass, by the host's clock (NaN: a mark
        that was not made; before_backward may be missing: no ``on_before_backward`` call)."""
        before = self._host_before_backward
        return (before <= self._host_computed or before != before) and self._host_computed <= (
            self._host_after_backward
        )

    def _add(self, phases: tuple[float, ...], samples: int) -> None:
        sums = self._sums
        for i, seconds in enumerate(phases):
            if seconds > 0.0:
                sums[i] += seconds
        sums[-2] += samples
        sums[-1] += 1

    def _count_finished(self, wait: bool) -> None:
        """Adds the phases of the pending micro-batches the clock can measure (with ``wait``: all of them)."""
        clock = self._clock
        while self._pending:
            step = self._pending[0]
            if wait:
                clock.wait(step.end)
            elif not all(clock.ready(mark) for mark in step.all_marks()):
                return
            self._pending.popleft()
            self._add(step.phases(clock, sum(clock.seconds(start, stop) for start, stop in step.fetches)), step.samples)

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
        self.report = summarize_scaling(
            [dict(zip(_TOTALS, row, strict=True)) for row in per_rank],
            threshold=self.threshold,
            single_device_samples_per_second=self.single_device_samples_per_second,
            micro_batches_per_step=_aggregation(trainer),
            timing=self._clock.name,
            gradient_compression=getattr(getattr(trainer.strategy, "config", None), "gradient_compression", None),
        )
        if not trainer.is_global_zero:
            return
        if self.verbose:
            rank_zero_info(f"ScalingReport: {self.report['verdict']}\n{format_scaling_report(self.report)}")
        if self.output_file is not None:
            self.output_file.parent.mkdir(parents=True, exist_ok=True)
            self.output_file.write_text(json.dumps(self.report, indent=2))
        if not self.report["micro_batches"]:
            return
        metrics = {f"scaling/{key}": value for key, value in _loggable(self.report).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


@dataclass
class _CountedStep:
    """A counted micro-batch: its clock marks (the previous micro-batch's end, the (start, stop) pairs of ``next()``
    on the loader before it, start, before_backward, the end of the backward computation when it ended during this
    backward, after_backward, end; None: not reached) and its samples."""

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

    def phases(self, clock: StepClock, fetch_seconds: float) -> tuple[float, ...]:
        """Seconds per phase of :data:`STEP_PHASES` on ``clock`` (all its marks must have happened), with
        ``fetch_seconds`` the clock's time across ``next()`` on the loader (on a device clock: nothing is queued
        in it, the time the device went idle, if it ran out of work, waiting for data)."""
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
    """``trainer.profiler`` during training with a :class:`ScalingReport`: times Lightning's training batch fetch
    for the report and passes every action on to the profiler it wraps (by default Lightning's no-op one)."""

    def __init__(self, wrapped: Profiler, report: ScalingReport) -> None:
        super().__init__()
        self.wrapped, self.report = wrapped, report

    def profile(self, action_name: str) -> Any:
        """The wrapped profiler's own ``profile`` for every action but the batch fetch (which Lightning times with
        ``start`` and ``stop``): the ~40 actions profiled per step cost what they cost without this wrapper."""
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


def summarize_scaling(
    per_rank: list[dict[str, float]],
    threshold: float = 0.2,
    single_device_samples_per_second: float | None = None,
    micro_batches_per_step: int = 1,
    communication_measured: bool = True,
    timing: str = "host",
    gradient_compression: str | None = None,
) -> dict[str, Any]:
    """The report of :class:`ScalingReport` from each rank's totals (seconds per phase, samples, micro-batches):
    per-micro-batch milliseconds and shares of each phase (means over ranks), samples/s, efficiency, verdict.
    ``communication_measured=False``: exposed communication could not be told apart from backward; ``timing``:
    the clock of the figures (``"host"`` or ``"<device> events"``); ``gradient_compression``: the strategy's, so
    that the advice names what is not in use yet."""
    world_size = len(per_rank)
    counted = [rank for rank in per_rank if rank["micro_batches"] > 0]
    if not counted:
        return {
            "world_size": world_size,
            "micro_batches": 0,
            "verdict": "no training step was counted (fewer steps than `skip_first_steps`)",
        }
    ms_per_micro_batch = {
        phase: statistics.fmean(1000 * rank[phase] / rank["micro_batches"] for rank in counted) for phase in STEP_PHASES
    }
    step_ms = sum(ms_per_micro_batch.values())
    fractions = {phase: (ms / step_ms if step_ms > 0 else 0.0) for phase, ms in ms_per_micro_batch.items()}
    slowest = max(sum(rank[phase] for phase in STEP_PHASES) for rank in counted)
    samples = sum(rank["samples"] for rank in counted)
    samples_per_second = samples / slowest if slowest > 0 and samples > 0 else None
    efficiency = None
    if samples_per_second is not None and single_device_samples_per_second:
        efficiency = samples_per_second / (world_size * single_device_samples_per_second)
    report = {
        "world_size": world_size,
        "micro_batches": int(min(rank["micro_batches"] for rank in counted)),
        "micro_batches_per_optimizer_step": micro_batches_per_step,
        "ms_per_micro_batch": ms_per_micro_batch,
        "fractions": fractions,
        "samples_per_second": samples_per_second,
        "single_device_samples_per_second": single_device_samples_per_second,
        "scaling_efficiency": efficiency,
        "communication_measured": communication_measured,
        "timing": timing,
        "gradient_compression": gradient_compression,
        "per_rank": per_rank,
    }
    report["verdict"] = scaling_verdict(report, threshold)
    return report


def scaling_verdict(report: dict[str, Any], threshold: float = 0.2) -> str:
    """One line on what limits scaling: data loading, exposed communication or the time between steps when any
    takes at least ``threshold`` of a step (the largest first), else the computation."""
    fractions = report["fractions"]
    efficiency = report.get("scaling_efficiency")
    suffix = "" if efficiency is None else f"; scaling efficiency {efficiency:.0%}"
    if not report.get("communication_measured", True):
        suffix += " (exposed communication not measured, counted in backward: needs ShardPlusStrategy)"
    advice = {
        "data": "data loading takes {:.0%} of each step: raise num_workers, set pin_memory/persistent_workers, "
        "or check with SyntheticDataModule that the model scales without your data",
        "communication": "gradient communication not hidden behind backward takes {:.0%} of each step: try "
        + _communication_options(report),
        "between_steps": "the time between steps takes {:.0%} of each step (moving batches to the device, logging, "
        "checkpointing, callbacks, waiting for a slower rank): log less often, or look for the slow rank",
    }
    limits = sorted((phase for phase in advice if fractions[phase] >= threshold), key=lambda p: -fractions[p])
    if limits:
        return "; ".join(advice[phase].format(fractions[phase]) for phase in limits) + suffix
    compute = fractions["forward"] + fractions["backward"] + fractions["optimizer"]
    return f"compute-bound: forward/backward/optimizer take {compute:.0%} of each step" + suffix


_CLOCK_NAMES = {"host": "the host's wall clock"}


def _communication_options(report: dict[str, Any]) -> str:
    """What would cut exposed communication, leaving out what the run already does."""
    options = []
    compression = report.get("gradient_compression")
    if compression in (None, "none"):
        options.append("gradient_compression ('fp16', 'powersgd')")
    elif compression != "powersgd":
        options.append("gradient_compression='powersgd'")
    micro_batches = report.get("micro_batches_per_optimizer_step", 1)
    options.append("aggregation_frequency > 1" if micro_batches == 1 else f"aggregation_frequency > {micro_batches}")
    options.append("another tensor_fusion_threshold_mb (or auto_tune_tensor_fusion)")
    return ", ".join(options[:-1]) + ", or " + options[-1]


def format_scaling_report(report: dict[str, Any]) -> str:
    """The report as a few aligned lines: milliseconds and share of each phase, samples/s, efficiency."""
    if not report.get("micro_batches"):
        return report["verdict"]
    lines = [
        f"{phase:>13}: {report['ms_per_micro_batch'][phase]:9.2f} ms/step {report['fractions'][phase]:6.1%}"
        for phase in STEP_PHASES
    ]
    rate = report["samples_per_second"]
    lines.append(f"{'samples/s':>13}: " + ("unknown" if rate is None else f"{rate:.1f}"))
    lines.append(f"{'ranks':>13}: {report['world_size']}, {report['micro_batches']} steps counted per rank")
    lines.append(f"{'timed with':>13}: " + _CLOCK_NAMES.get(report.get("timing", "host"), report.get("timing", "")))
    if report["scaling_efficiency"] is not None:
        lines.append(f"{'efficiency':>13}: {report['scaling_efficiency']:.1%}")
    return "\n".join(lines)


def _loggable(report: dict[str, Any]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for phase in STEP_PHASES:
        figures[f"{phase}_ms"] = report["ms_per_micro_batch"][phase]
        figures[f"{phase}_fraction"] = report["fractions"][phase]
    for key in ("samples_per_second", "scaling_efficiency"):
        if report.get(key) is not None:
            figures[key] = report[key]
    return figures
