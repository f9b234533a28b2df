"""Large-batch training: :class:`ScaleLearningRate` scales the learning rate with the global batch, after an
optional warmup (Goyal et al. 2017, as Horovod and Determined apply it); :class:`~lightning_shardplus.LARS`,
the layer-wise adaptive optimizer, lives in ``lars.py``."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_shardplus.data.aggregation import effective_batch_size, micro_batches_per_step
from lightning_shardplus.data.group import data_parallel_size
from lightning_shardplus.large_batch.lars import LARS
from lightning_shardplus.validation import check_bool, check_choice, check_int

__all__ = ["LARS", "SCALING_RULES", "ScaleLearningRate", "scaling_factor", "warmup_factor"]

ScalingRule = Literal["linear", "sqrt", "none"]
SCALING_RULES: tuple[str, ...] = ("linear", "sqrt", "none")


def scaling_factor(rule: str, batch_ratio: float) -> float:
    """The learning-rate multiplier of ``rule`` for ``batch_ratio = effective batch / reference batch``:
    ``batch_ratio`` (linear), ``sqrt(batch_ratio)`` (sqrt) or 1 (none)."""
    check_choice("rule", rule, SCALING_RULES)
    return float(batch_ratio) if rule == "linear" else math.sqrt(batch_ratio) if rule == "sqrt" else 1.0


def warmup_factor(factor: float, step: int, warmup_steps: int) -> float:
    """``factor`` reached linearly over ``warmup_steps`` optimizer steps: 1 at step 0, ``factor`` from step
    ``warmup_steps`` on (steps counted from 0)."""
    return factor if step >= warmup_steps else 1.0 + (factor - 1.0) * step / warmup_steps


def _value(rate: Any) -> Any:
    """A learning rate as it is now (a tensor rate is copied: it changes in place)."""
    return rate.detach().clone() if isinstance(rate, torch.Tensor) else rate


def _check_warmup_epochs(value: Any) -> None:
    message = f"`warmup_epochs`={value!r} is not valid: expected a finite number >= 0 (fractions allowed)."
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(message)
    if not value >= 0 or math.isinf(value):  # `not >=` also rejects NaN
        raise ValueError(message)


class ScaleLearningRate(Callback):
    """Scale the learning rate by ``rule(effective_batch / reference_batch_size)`` after an optional linear warmup.

    ``effective_batch`` is ``ShardPlusStrategy.effective_batch_size``: per-device batch x world size x micro-batches
    per step. The factor multiplies the optimizer's rates only while its ``step`` runs, so schedulers,
    ``LearningRateMonitor`` and checkpoints see the unscaled rates; a resumed run continues the warmup. ``rule``:
    ``"linear"``, ``"sqrt"`` or ``"none"``; ``reference_batch_size`` None: the per-device batch size; ``warmup_steps``
    or ``warmup_epochs`` (not both). The arguments: docs/large-batch.md."""

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
        self.reference_batch_size, self.log_lr = reference_batch_size, log_lr
        self.warmup_steps, self.warmup_epochs = warmup_steps, warmup_epochs
        self.effective_batch_size: int | None = None  # this and the two below: resolved when training starts
        self.factor, self.resolved_warmup_steps = 1.0, 0
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restored_steps = None  # a checkpoint's state, if any, is loaded after this hook

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        aggregation_steps = micro_batches_per_step(trainer)
        world_size = data_parallel_size(trainer)  # the ranks that read different samples
        self.effective_batch_size = effective_batch_size(trainer)
        if self.reference_batch_size is None:
            ratio = float(world_size * aggregation_steps)
        elif self.effective_batch_size is None:
            raise ValueError(
                f"ScaleLearningRate got `reference_batch_size`={self.reference_batch_size} but cannot find the "
                "per-device batch size: the datamodule has no `per_device_batch_size` and no training DataLoader has a "
                "`batch_size`. Give the DataLoader a batch_size, or leave `reference_batch_size` None."
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

        batch, reference = self.effective_batch_size, self.reference_batch_size or "the per-device batch"
        per_device = "?" if batch is None else batch // (world_size * aggregation_steps)
        rank_zero_info(
            f"ScaleLearningRate: effective batch {batch or 'unknown'} ({world_size} processes x {per_device} per "
            f"device x {aggregation_steps} aggregated micro-batches), reference {reference}: {self.rule} factor "
            f"{self.factor:g}, warmup "
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

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        self._restore_all()
        self._remove_hooks()

    on_train_end = teardown

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_all()

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
            "steps": list(steps), "rule": self.rule, "factor": self.factor, "warmup_steps": self.resolved_warmup_steps,
            "reference_batch_size": self.reference_batch_size, "effective_batch_size": self.effective_batch_size,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        steps = state_dict.get("steps")
        self._restored_steps = [int(step) for step in steps] if steps else None

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
        return math.floor(self.warmup_epochs * math.ceil(batches / micro_batches) + 0.5)  # optimizer steps per epoch

    def _make_pre_hook(self, index: int) -> Any:
        def scale(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            # torch runs the hooks again in every overridden `step` of a subclass chain: scale only once.
            self._depth[index] += 1
            if self._depth[index] > 1:
                return
            factor = self.factor_at(self._steps[index])
            self._user_lrs[index] = [_value(group["lr"]) for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= factor  # a tensor rate in place (a scheduler may hold it), a float replaced
            self._applied[index] = [_value(group["lr"]) for group in optimizer.param_groups]

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
        for group, rate in zip(self._optimizers[index].param_groups, self._user_lrs.pop(index, []), strict=False):
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
