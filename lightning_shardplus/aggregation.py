"""Gradient aggregation: several micro-batches per optimizer step, gradient communication on the last only.

``ShardPlusStrategy(aggregation_frequency=N)`` builds on Lightning's own accumulation loop by setting
``trainer.accumulate_grad_batches = N``. Lightning then, for each window of ``N`` micro-batches of an epoch
(the last window of an epoch may be shorter):

- zeroes the gradients before the first micro-batch of the window;
- runs every micro-batch but the last inside DDP's ``no_sync`` (forward and backward): gradients accumulate
  locally in ``param.grad`` and nothing is sent;
- runs the last micro-batch (the ``N``-th, or the final one of the epoch) normally, so DDP's backward
  all-reduces the window's accumulated gradient once, through the communication hook if one is registered;
  then steps the optimizer, and LR schedulers with ``interval="step"``, once;
- divides every micro-batch's loss by ``N`` before its backward.

The last point is only right for full windows: a short last window of ``k < N`` micro-batches is still divided
by ``N`` (Lightning#19987). The strategy therefore corrects the gradient once per optimizer step, right after
the backward of the window's last micro-batch (so after the all-reduce) and before anything else sees it, by
:func:`gradient_correction`:

- ``average_aggregated_gradients=True``: ``N / k``, so the optimizer sees the mean over the ``k``
  micro-batches actually aggregated (1 for full windows);
- ``average_aggregated_gradients=False``: ``N``, so the optimizer sees their sum (Horovod's
  ``average_aggregated_gradients=False``): summed over micro-batches, still averaged over ranks.

The correction wraps the closure that Lightning hands to the optimizer step, so it runs before the precision
plugin unscales AMP gradients (it is linear, so scaling a scaled gradient is the same), before the
``on_before_optimizer_step`` hooks and before gradient clipping (which thus clips the corrected gradient).
``on_after_backward`` still sees the uncorrected, Lightning-normalized gradients of each micro-batch.

A checkpoint saved inside a window (``trainer.save_checkpoint`` from a callback between optimizer steps) holds
every rank's gradient accumulated so far (each rank's own: ``no_sync`` keeps them local), under
:data:`CHECKPOINT_KEY`; a run resumed from it on the same world size gives them back and ends the window with
the same gradient as the uninterrupted run. It costs world size x the gradients' size in the checkpoint; at
optimizer-step boundaries nothing is added.

:class:`GradientAggregation` is the strategy's component for one fit; the functions hold the arithmetic and the
batch-size bookkeeping. This module imports neither the strategy nor the other algorithm modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_shardplus import _lightning


def window_length(micro_batches_done: int, frequency: int) -> int:
    """The number of micro-batches in the window whose last micro-batch is number ``micro_batches_done`` of
    the epoch (counted from 1): ``frequency`` for full windows, fewer for the short last window of an epoch.

    Lightning starts a window at every ``frequency``-th micro-batch of an epoch (it zeroes the gradients when
    ``batch_idx % frequency == 0``), so the window ending here began at micro-batch
    ``frequency * floor((done - 1) / frequency) + 1``.
    """
    if micro_batches_done < 1 or frequency < 1:
        raise ValueError(f"window_length({micro_batches_done}, {frequency}): both must be >= 1")
    return (micro_batches_done - 1) % frequency + 1


def gradient_correction(frequency: int, aggregated: int, average: bool) -> float:
    """The factor that turns Lightning's accumulated gradient (the sum of ``aggregated`` micro-batch gradients
    of ``loss / frequency``) into their mean (``average``) or their sum."""
    if not 1 <= aggregated <= frequency:
        raise ValueError(f"gradient_correction: `aggregated`={aggregated} must be in [1, {frequency}]")
    return frequency / aggregated if average else float(frequency)


@torch.no_grad()
def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing ``.grad`` in place by ``factor`` (a no-op for 1)."""
    if factor == 1:
        return
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


def check_accumulation(aggregation_frequency: int, accumulate_grad_batches: Any) -> None:
    """Refuse two different numbers of micro-batches per optimizer step, and say which argument to keep."""
    if aggregation_frequency > 1 and accumulate_grad_batches not in (1, aggregation_frequency):
        raise ValueError(
            f"ShardPlusStrategy(aggregation_frequency={aggregation_frequency}) and "
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}) set two different numbers of "
            "micro-batches per optimizer step. Use `aggregation_frequency` only (it also normalizes the "
            "short last window of an epoch correctly): remove `accumulate_grad_batches` from the Trainer."
        )


def check_static_graph(micro_batches: int, static_graph: bool, argument: str) -> None:
    """Refuse DDP's ``static_graph=True`` with more than one micro-batch per optimizer step: torch's DDP stops on
    the first backward inside ``no_sync()`` (an ``expect_autograd_hooks_`` internal assert in its reducer,
    pytorch/pytorch#143580), under plain ``ddp`` as well. ``argument`` names what set the micro-batches."""
    if static_graph and micro_batches > 1:
        raise ValueError(
            f"`static_graph`=True and {argument}={micro_batches} do not work together: torch's DDP fails on the "
            "first backward of an accumulation window with a static graph (pytorch/pytorch#143580). Use "
            "`static_graph=False`, or one micro-batch per optimizer step."
        )


def check_aggregation(frequency: int, trainer: Any, model: Any | None, static_graph: bool = False) -> None:
    """Refuse, before a fit starts, what cannot work with ``aggregation_frequency`` = ``frequency``."""
    accumulation = trainer.accumulate_grad_batches
    check_accumulation(frequency, accumulation)
    if frequency == 1:  # `aggregation_frequency` > 1 with a static graph is refused when the strategy is built
        if isinstance(accumulation, int):
            check_static_graph(accumulation, static_graph, "`Trainer(accumulate_grad_batches)`")
        return
    if model is not None and not model.automatic_optimization:
        raise ValueError(
            f"`aggregation_frequency`={frequency} needs automatic optimization, but "
            f"{type(model).__name__} sets `automatic_optimization = False`: use aggregation_frequency=1 "
            "and aggregate yourself (manual_backward inside `self.trainer.strategy.model.no_sync()` on "
            "all but the last micro-batch)."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        raise ValueError(
            f"`aggregation_frequency`={frequency} and a GradientAccumulationScheduler callback both set "
            "the micro-batches per optimizer step: use one of them (aggregation_frequency=1 to keep the "
            "scheduler)."
        )


class GradientAggregation:
    """Aggregation windows for one fit: Lightning's accumulation loop runs them (``trainer.accumulate_grad_batches``
    is set to ``frequency`` until :meth:`close` puts the user's value back), and :meth:`wrap_closure` corrects each
    window's gradient (the mean over the micro-batches actually aggregated, or their sum). ``ranks_correction``
    (micro-batches aggregated, average) -> factor corrects it further where some ranks had no
    data (``uneven.EvenSteps.gradient_correction``).

    Example::

        aggregation = GradientAggregation(trainer, frequency=4, average=True)
        closure = aggregation.wrap_closure(optimizer, closure)  # in the strategy's optimizer_step
    """

    def __init__(
        self,
        trainer: Any,
        frequency: int,
        average: bool,
        ranks_correction: Callable[[int, bool], float] | None = None,
    ) -> None:
        self.trainer, self.average, self.ranks_correction = trainer, average, ranks_correction
        self._user_accumulate = trainer.accumulate_grad_batches
        self._checkpointed: dict[str, Any] | None = None  # the window state of a checkpoint being resumed
        if frequency > 1:
            trainer.accumulate_grad_batches = frequency

    @property
    def micro_batches_per_step(self) -> int:
        return micro_batches_per_step(self.trainer)

    def close(self) -> None:
        """The fit ends: the Trainer's own ``accumulate_grad_batches`` again."""
        self.trainer.accumulate_grad_batches = self._user_accumulate

    def on_train_start(self, gradient_compression: str) -> None:
        """Say what one optimizer step is; after a resume, keep step-triggered checkpoints from saving mid-window,
        and give a window resumed in its middle the gradients it had accumulated (:meth:`load_state_dict`)."""
        trainer, micro_batches = self.trainer, self.micro_batches_per_step
        if trainer.ckpt_path is not None and micro_batches > 1:
            # resumed at an optimizer step: checkpointing "every n steps" must not save again mid-window
            _lightning.mark_resumed_step_saved(trainer)
            self._resume_window()
        per_device, batch = micro_batch_size(trainer), effective_batch_size(trainer)
        rank_zero_info(
            f"shardplus: effective batch {batch or 'unknown'} = {per_device or '?'} per device x "
            f"{trainer.world_size} processes x {micro_batches} micro-batches per optimizer step "
            f"({'mean' if self.average else 'sum'} of aggregated gradients); "
            f"gradient compression {gradient_compression!r}"
        )

    def wrap_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (forward + backward of the window's last micro-batch, whose backward all-reduced the
        window's gradient), then the gradient corrected from Lightning's ``sum(loss / N)`` to the mean over the
        micro-batches actually aggregated (or their sum). Runs before unscaling, hooks and clipping."""
        trainer, frequency, ranks_correction = self.trainer, self.micro_batches_per_step, self.ranks_correction
        if frequency == 1 and ranks_correction is None:
            return closure
        if not trainer.lightning_module.automatic_optimization or not trainer.training:
            return closure

        def closure_then_normalize() -> Any:
            result = closure()
            done = _lightning.micro_batches_done_in_epoch(trainer)
            aggregated = window_length(done, frequency)
            factor = gradient_correction(frequency, aggregated, self.average)
            if ranks_correction is not None:
                factor *= ranks_correction(aggregated, self.average)
            parameters = (p for group in optimizer.param_groups for p in group["params"])
            scale_gradients(parameters, factor)
            return result

        return closure_then_normalize

    def _inside_window(self) -> int | None:
        """The micro-batches trained in this epoch when that is inside a window (its gradient is accumulating
        locally, not yet all-reduced); None at an optimizer-step boundary."""
        trainer, frequency = self.trainer, self.micro_batches_per_step
        done = _lightning.micro_batches_trained_in_epoch(trainer)
        return done if done % frequency and done < trainer.num_training_batches else None

    def state_dict(self) -> dict[str, Any] | None:
        """Saved inside a window: every rank's accumulated gradient (each rank's own: the window's micro-batches but
        the last run under ``no_sync``), gathered on rank 0, which writes the checkpoint. A collective then: call it
        on every rank. None at optimizer-step boundaries (and on ranks other than 0)."""
        done = self._inside_window()
        if done is None:
            return None
        module = self.trainer.lightning_module
        local = {name: p.grad.detach().cpu().clone() for name, p in module.named_parameters() if p.grad is not None}
        per_rank: list[Any] | None = [local]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            per_rank = [None] * world if rank == 0 else None
            torch.distributed.gather_object(local, per_rank, dst=0)
        if per_rank is None:
            return None
        return window_entry(done, self.micro_batches_per_step, per_rank)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The window state of a checkpoint being resumed; its gradients are restored when training starts."""
        self._checkpointed = state

    def _resume_window(self) -> None:
        trainer, frequency = self.trainer, self.micro_batches_per_step
        entry, self._checkpointed = self._checkpointed, None
        if entry is not None and not _lightning.RESUMES_INSIDE_A_WINDOW:
            rank_zero_warn(
                f"shardplus: aggregation: this checkpoint was saved inside an aggregation window; Lightning "
                f"{_lightning.pl.__version__} resumes its batch count one micro-batch behind the saved run, so the "
                "window's accumulated gradients are not restored and the run does not equal an uninterrupted one "
                "(Lightning 2.5 or newer resumes the window exactly)."
            )
            return
        done = self._inside_window()
        if done is None:
            return
        if entry is None:
            rank_zero_warn(
                f"shardplus: resumed after micro-batch {done} of the epoch, inside an aggregation window of "
                f"{frequency}, from a checkpoint without the gradients accumulated in that window (written by "
                "another strategy or an older lightning_shardplus): the window's optimizer step lacks them, so the "
                "run does not equal an uninterrupted one."
            )
            return
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        message = restore_window_gradients(trainer.lightning_module, entry, done, frequency, rank, trainer.world_size)
        if message is not None:
            rank_zero_warn(f"shardplus: {message}")


CHECKPOINT_KEY = "shardplus_aggregation_window"


def window_entry(micro_batches_done: int, frequency: int, per_rank: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """What the strategy stores under ``checkpoint[CHECKPOINT_KEY]`` when it saves inside a window: every rank's
    accumulated gradient by parameter name (CPU tensors: ``torch.load(weights_only=True)`` reads them), and where
    in the epoch and in which windows they were taken."""
    return {
        "micro_batches_done": micro_batches_done,
        "aggregation_frequency": frequency,
        "world_size": len(per_rank),
        "per_rank": per_rank,
    }


@torch.no_grad()
def restore_window_gradients(
    module: torch.nn.Module, entry: dict[str, Any], micro_batches_done: int, frequency: int, rank: int, world_size: int
) -> str | None:
    """Give ``module``'s parameters the gradients a window had accumulated when a checkpoint was saved in it
    (:func:`window_entry`), resumed after ``micro_batches_done`` micro-batches with windows of ``frequency``.

    On the same world size each rank gets its own: the resumed window then ends with the same gradient, bitwise,
    as the uninterrupted run. On another, every rank gets their mean over the checkpoint's ranks, so that the
    all-reduce at the window's end (a mean over ranks) counts the first micro-batches as the checkpoint's ranks
    would have; the rest of the window is resharded. Returns a warning to show, or None."""
    if entry.get("aggregation_frequency") != frequency or entry.get("micro_batches_done") != micro_batches_done:
        return (
            f"the checkpoint holds the gradients of an aggregation window of {entry.get('aggregation_frequency')} "
            f"after micro-batch {entry.get('micro_batches_done')}, this run resumes a window of {frequency} after "
            f"micro-batch {micro_batches_done}: they are not restored, and the window's step lacks them."
        )
    per_rank = entry["per_rank"]
    message = None
    if len(per_rank) == world_size:
        gradients = per_rank[rank]
    else:
        # a rank without a parameter's gradient (unused there) contributed zero
        names = set().union(*per_rank)
        gradients = {name: sum(g[name] for g in per_rank if name in g) / len(per_rank) for name in names}
        message = (
            f"resumed inside an aggregation window saved on {len(per_rank)} processes, on {world_size}: every "
            "process starts from the mean of the gradients the checkpoint's processes had accumulated, and the rest "
            "of the window is resharded; the run equals no uninterrupted one."
        )
    parameters = dict(module.named_parameters())
    for name, gradient in gradients.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.shape != gradient.shape:
            return f"the checkpoint's accumulated gradient of {name!r} does not fit this model: none is restored."
    for name, gradient in gradients.items():
        parameter = parameters[name]
        gradient = gradient.to(device=parameter.device, dtype=parameter.dtype)
        if parameter.grad is None:
            parameter.grad = gradient
        else:
            parameter.grad.copy_(gradient)
    return message


# ---------------------------------------------------------------------------------------------- batch sizes


def dataloaders(loaders: Any) -> Iterator[DataLoader]:
    """The loaders inside what ``trainer.train_dataloader`` returns (a loader, or a list/dict of them): DataLoaders
    and what wraps one and forwards its attributes (``uneven.AgreedLoader``)."""
    if isinstance(loaders, dict):
        for value in loaders.values():
            yield from dataloaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from dataloaders(value)
    elif isinstance(loaders, DataLoader) or isinstance(getattr(loaders, "loader", None), DataLoader):
        yield loaders


def micro_batches_per_step(trainer: Any) -> int:
    """Micro-batches per optimizer step: Lightning's ``accumulate_grad_batches`` (``ShardPlusStrategy`` sets it
    to its ``aggregation_frequency`` for the fit: they are one count, never multiplied)."""
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        return 1
    return accumulate


def micro_batch_size(trainer: Any) -> int | None:
    """Samples per micro-batch on one device: the datamodule's ``per_device_batch_size`` if it has one, else
    the (first) training DataLoader's batch size; None when neither is known."""
    size = getattr(getattr(trainer, "datamodule", None), "per_device_batch_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    for loader in dataloaders(getattr(trainer, "train_dataloader", None)):
        size = loader.batch_size
        if size is None:  # a custom batch sampler
            size = getattr(loader.batch_sampler, "batch_size", None)
        if isinstance(size, int) and size >= 1:
            return size
    return None


def effective_batch_size(trainer: Any) -> int | None:
    """Samples per optimizer step over all processes: ``micro-batch size x world size x micro-batches per
    step``; None when the micro-batch size is unknown."""
    per_device = micro_batch_size(trainer)
    if per_device is None:
        return None
    return per_device * trainer.world_size * micro_batches_per_step(trainer)
