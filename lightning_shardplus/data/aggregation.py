"""Gradient aggregation: several micro-batches per optimizer step, gradient communication on the last only.
Lightning's accumulation loop runs the windows (``trainer.accumulate_grad_batches`` is set to the frequency); the
strategy corrects each window's gradient, since Lightning divides a short last window by the full frequency too
(Lightning#19987). Batch sizes: docs/batch-size.md; a checkpoint inside a window: docs/resume.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat.changes import Change, RunChanges
from lightning_shardplus.data.gradient_side import GradientSide
from lightning_shardplus.data.group import DataParallel, data_parallel_size
from lightning_shardplus.validation import class_name


def window_length(micro_batches_done: int, frequency: int) -> int:
    """The micro-batches in the window whose last is number ``micro_batches_done`` of the epoch (from 1):
    ``frequency``, or fewer for the short last window (Lightning starts one where ``batch_idx % frequency == 0``)."""
    return (micro_batches_done - 1) % frequency + 1


def gradient_correction(frequency: int, aggregated: int, average: bool) -> float:
    """The factor that turns Lightning's accumulated gradient (the sum of ``aggregated`` micro-batch gradients
    of ``loss / frequency``) into their mean (``average``) or their sum."""
    if not 1 <= aggregated <= frequency:
        raise ValueError(f"gradient_correction: `aggregated`={aggregated} must be in [1, {frequency}]")
    return frequency / aggregated if average else float(frequency)


def check_static_graph(micro_batches: int, static_graph: bool, argument: str) -> None:
    """Refuse DDP's ``static_graph=True`` with more than one micro-batch per optimizer step: torch's reducer
    asserts on the first backward inside ``no_sync()`` (pytorch/pytorch#143580), under plain ``ddp`` too."""
    if static_graph and micro_batches > 1:
        raise ValueError(
            f"`static_graph`=True and {argument}={micro_batches} do not work together: torch's DDP fails on the "
            "first backward of an accumulation window with a static graph (pytorch/pytorch#143580). Use "
            "`static_graph=False`, or one micro-batch per optimizer step."
        )


def check_aggregation(
    strategy: str, frequency: int, trainer: Any, model: Any | None, static_graph: bool = False
) -> None:
    """Refuse, before a fit starts, what cannot work with ``aggregation_frequency`` = ``frequency`` of the strategy
    class named ``strategy``."""
    accumulation = trainer.accumulate_grad_batches
    if frequency > 1 and accumulation not in (1, frequency):
        raise ValueError(
            f"{strategy}(aggregation_frequency={frequency}) and "
            f"Trainer(accumulate_grad_batches={accumulation}) set two different numbers of "
            "micro-batches per optimizer step. Use `aggregation_frequency` only (it also normalizes the "
            "short last window of an epoch correctly): remove `accumulate_grad_batches` from the Trainer."
        )
    if frequency == 1:  # `aggregation_frequency` > 1 with a static graph is refused when the strategy is built
        if isinstance(accumulation, int):
            check_static_graph(accumulation, static_graph, "`Trainer(accumulate_grad_batches)`")
        return
    if model is not None and not model.automatic_optimization:
        raise ValueError(
            f"`aggregation_frequency`={frequency} needs automatic optimization, but {class_name(model)} sets "
            "`automatic_optimization = False`: use aggregation_frequency=1 and aggregate yourself (manual_backward "
            "inside `self.trainer.strategy.model.no_sync()` on all but the last micro-batch)."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        raise ValueError(
            f"`aggregation_frequency`={frequency} and a GradientAccumulationScheduler callback both set the "
            "micro-batches per optimizer step: use one of them (aggregation_frequency=1 to keep the scheduler)."
        )


class GradientAggregation:
    """Aggregation windows for one fit: ``trainer.accumulate_grad_batches`` is ``frequency`` until the run ends,
    and :meth:`wrap_closure` corrects each window's gradient. ``ranks_correction(aggregated, average)`` corrects
    it further where some ranks had no data (``uneven.EvenSteps.gradient_correction``). A checkpoint inside a window
    holds the window's gradients so far as the gradient side reads them (``gradients.window_gradients``: each rank's
    under DDP, their sum over the data-parallel ranks under FSDP2; None where they cannot be read: a resume there
    warns that the window's step lacks them)."""

    def __init__(
        self,
        trainer: Any,
        frequency: int,
        average: bool,
        ranks_correction: Callable[[int, bool], float] | None,
        gradients: GradientSide,
        data_parallel: DataParallel,
        changes: RunChanges,
    ) -> None:
        self.trainer, self.average, self.ranks_correction = trainer, average, ranks_correction
        self.gradients, self.data_parallel = gradients, data_parallel
        self._checkpointed: dict[str, Any] | None = None  # the window state of a checkpoint being resumed
        self._announced = False
        if frequency > 1:  # until the run's end
            changes.set(Change.ACCUMULATION, trainer, "accumulate_grad_batches", frequency)

    @property
    def micro_batches_per_step(self) -> int:
        return micro_batches_per_step(self.trainer)

    def announce(self, loader: Any) -> None:
        """Log what one optimizer step is, once per fit, before the progress bar starts; not with one micro-batch."""
        trainer, micro_batches = self.trainer, self.micro_batches_per_step
        if self._announced or micro_batches == 1:
            return
        self._announced = True
        per_device = micro_batch_size(trainer, loader)
        replicas = data_parallel_size(trainer)
        batch = "unknown" if per_device is None else per_device * replicas * micro_batches
        rank_zero_info(
            f"shardplus: effective batch {batch} = {per_device or '?'} per device x {replicas} processes x "
            f"{micro_batches} micro-batches per optimizer step ({'mean' if self.average else 'sum'} of aggregated "
            "gradients)"
        )

    def on_train_start(self) -> None:
        """After a resume, keep step-triggered checkpoints from saving mid-window and give a window resumed in its
        middle its accumulated gradients."""
        if self.trainer.ckpt_path is not None and self.micro_batches_per_step > 1:
            # resumed at an optimizer step: checkpointing "every n steps" must not save again mid-window
            _lightning.mark_resumed_step_saved(self.trainer)
            self._resume_window()

    def wrap_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the window's last micro-batch, whose backward all-reduced the gradient), then the gradient
        corrected from Lightning's ``sum(loss / N)`` to the mean (or sum) over the micro-batches aggregated: before
        AMP unscaling, ``on_before_optimizer_step`` and clipping."""
        trainer, frequency, ranks_correction = self.trainer, self.micro_batches_per_step, self.ranks_correction
        if frequency == 1 and ranks_correction is None:
            return closure
        if not trainer.lightning_module.automatic_optimization or not trainer.training:
            return closure

        def closure_then_normalize() -> Any:
            result = closure()
            aggregated = window_length(_lightning.micro_batches_done_in_epoch(trainer), frequency)
            factor = gradient_correction(frequency, aggregated, self.average)
            if ranks_correction is not None:
                factor *= ranks_correction(aggregated, self.average)
            if factor != 1:
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for grad in (p.grad for p in group["params"] if p.grad is not None):
                            grad.mul_(factor)
            return result

        return closure_then_normalize

    def _inside_window(self) -> int | None:
        """The micro-batches trained in this epoch when that is inside a window; None at a step boundary."""
        trainer, frequency = self.trainer, self.micro_batches_per_step
        done = _lightning.micro_batches_trained_in_epoch(trainer)
        return done if done % frequency and done < trainer.num_training_batches else None

    def state_dict(self) -> dict[str, Any] | None:
        """Inside a window, the gradients accumulated so far, on rank 0 (``gradients.window_gradients``: a
        collective, called on every rank). None at optimizer-step boundaries and on ranks other than 0."""
        done = self._inside_window()
        if done is None:
            return None
        module, frequency = self.trainer.lightning_module, self.micro_batches_per_step
        return self.gradients.window_gradients(module, self.data_parallel, done, frequency)

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
                "another strategy, or under FSDP2 where they cannot be read: a unit with a `reduce_dtype` of its own "
                "or that no micro-batch of the window used, torch older than 2.6): the window's optimizer step lacks "
                "them, so the run does not equal an uninterrupted one."
            )
            return
        module, rank, replicas = trainer.lightning_module, self.data_parallel.rank, data_parallel_size(trainer)
        set_gradients = self.gradients.set_window_gradients
        message = restore_window_gradients(module, entry, done, frequency, rank, replicas, set_gradients)
        if message is not None:
            rank_zero_warn(f"shardplus: {message}")


CHECKPOINT_KEY = "shardplus_aggregation_window"


def window_entry(micro_batches_done: int, frequency: int, per_rank: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The checkpoint entry of a save inside a window: every rank's accumulated gradient by parameter name (CPU
    tensors, which ``torch.load(weights_only=True)`` reads) and where in the epoch they were taken."""
    return {
        "micro_batches_done": micro_batches_done,
        "aggregation_frequency": frequency,
        "world_size": len(per_rank),
        "per_rank": per_rank,
    }


@torch.no_grad()
def restore_window_gradients(
    module: torch.nn.Module, entry: dict[str, Any], micro_batches_done: int, frequency: int, rank: int, world_size: int,
    set_gradients: Callable[[torch.nn.Module, dict[str, torch.Tensor]], None],
) -> str | None:
    """Give ``module``'s parameters the gradients of :func:`window_entry`: each rank its own on the same world size
    (the window ends bitwise as uninterrupted), else every rank the mean over the checkpoint's ranks (the window's
    all-reduce then counts them as those ranks would have), through the gradient side's ``set_gradients``. Returns a
    warning to show, or None."""
    if entry.get("aggregation_frequency") != frequency or entry.get("micro_batches_done") != micro_batches_done:
        return (
            f"the checkpoint holds the gradients of an aggregation window of {entry.get('aggregation_frequency')} "
            f"after micro-batch {entry.get('micro_batches_done')}, this run resumes a window of {frequency} after "
            f"micro-batch {micro_batches_done}: they are not restored, and the window's step lacks them."
        )
    if "data_parallel_sum" in entry:  # FSDP2: every rank starts from the mean, which the reduce-scatter sums back
        saved, per_rank = entry["world_size"], [entry["data_parallel_sum"]]
        gradients = {name: total / saved for name, total in entry["data_parallel_sum"].items()}
    else:
        saved, per_rank = len(entry["per_rank"]), entry["per_rank"]
        names = [name for name, _ in module.named_parameters() if any(name in g for g in per_rank)]
        # on another world size: the mean, a rank without a parameter's gradient (unused there) contributing zero
        gradients = per_rank[rank] if saved == world_size else {
            name: sum(g[name] for g in per_rank if name in g) / saved for name in names
        }  # fmt: skip
    message = None
    if saved != world_size:
        message = (
            f"resumed inside an aggregation window saved on {saved} processes, on {world_size}: every "
            "process starts from the mean of the gradients the checkpoint's processes had accumulated, and the rest "
            "of the window is resharded; the run equals no uninterrupted one."
        )
    shapes = {name: p.shape for name, p in module.named_parameters()}
    saved_shapes = {name: g.shape for g in per_rank for name, g in g.items()}  # the same on every rank
    misfits = [name for name, shape in saved_shapes.items() if name not in shapes or shapes[name] != shape]
    if misfits:
        return f"the checkpoint's accumulated gradient of {misfits[0]!r} does not fit this model: none is restored."
    set_gradients(module, gradients)
    return message


# ---------------------------------------------------------------------------------------------- batch sizes


def dataloaders(loaders: Any) -> Iterator[DataLoader]:
    """The DataLoaders (or wrappers forwarding to one, ``uneven.AgreedLoader``) in ``trainer.train_dataloader``."""
    if isinstance(loaders, (dict, list, tuple)):
        for value in loaders.values() if isinstance(loaders, dict) else loaders:
            yield from dataloaders(value)
    elif isinstance(loaders, DataLoader) or isinstance(getattr(loaders, "loader", None), DataLoader):
        yield loaders


def micro_batches_per_step(trainer: Any) -> int:
    """Micro-batches per optimizer step: Lightning's ``accumulate_grad_batches`` (the strategy's
    ``aggregation_frequency`` during a fit: one count, never multiplied)."""
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        return 1
    return accumulate


def micro_batch_size(trainer: Any, loaders: Any = None) -> int | None:
    """Samples per micro-batch on one device: the datamodule's ``per_device_batch_size``, else the first training
    DataLoader's batch size (of ``loaders``, else the Trainer's); None when neither is known."""
    size = getattr(getattr(trainer, "datamodule", None), "per_device_batch_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    for loader in dataloaders(getattr(trainer, "train_dataloader", None) if loaders is None else loaders):
        if (size := loader_batch_size(loader)) is not None:
            return size
    return None


def loader_batch_size(loader: DataLoader) -> int | None:
    """Samples per batch of ``loader`` (its ``batch_size``, or its batch sampler's); None when unknown."""
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size >= 1 else None


def effective_batch_size(trainer: Any) -> int | None:
    """Samples per optimizer step over all processes: ``micro-batch size x world size x micro-batches per
    step``; None when the micro-batch size is unknown."""
    per_device = micro_batch_size(trainer)
    return None if per_device is None else per_device * data_parallel_size(trainer) * micro_batches_per_step(trainer)
