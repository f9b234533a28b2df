"""Cross-rank reduction of logged metrics: fused averaging of training metrics, and exact evaluation.

Evaluation
----------
Exact evaluation: values logged with ``self.log`` in ``validation_step``/``test_step`` (and the evaluation
batch hooks) are reduced across ranks once, at the end of the evaluation epoch, from each rank's running sums
and sample counts, so the epoch values equal those of a single-process run over the same samples. No
collective runs per batch (ranks may hold different numbers of batches), and a rank that logged nothing, for
example one with no evaluation sample, still takes part.


Training
--------
By default Lightning logs rank 0's own training values; with ``sync_dist=True`` it pays
a barrier plus an all_reduce per value per step. With ``ShardPlusStrategy(average_training_metrics=True)``
every scalar logged with ``on_step=True`` from ``training_step`` and the training-batch hooks
(``on_train_batch_start``, the backward and optimizer hooks) is collected on each rank and, once per
logged step, replaced by its reduction over all ranks, computed by ONE ``all_reduce`` for all values
together:

- plain values (and ``sync_dist=True`` values with ``reduce_fx="mean"``): the mean over ranks weighted by
  batch size: ``self.log(..., batch_size=...)`` where given, else the size Lightning infers from the batch
  (as it does for epoch means), else 1;
- ``sync_dist=True`` values with ``reduce_fx`` ``"sum"``, ``"max"`` or ``"min"``: that reduction over
  ranks, as Lightning's own sync would compute it (folded into the same collective; Lightning's sync is
  skipped).

A logged step is an optimizer step in automatic optimization: with gradient accumulation
(``aggregation_frequency`` / ``accumulate_grad_batches`` = N) the value logged at a step reduces every
micro-batch of the window on every rank (for a mean: the batch-weighted mean over the N micro-batches of
all ranks, i.e. over the whole global batch). Between optimizer steps ``callback_metrics`` and the
progress bar keep the previous step's value. In manual optimization every batch is a logged step. Epoch
aggregates (``on_epoch=True``) are accumulated from the same reduced values, so they are identical on all
ranks and consistent with the step values.

When the collective runs: values normally come from ``training_step`` (and the hooks before backward), so the
collective is started, without waiting, when backward begins (``on_before_backward`` of the step's last micro-
batch) and read in ``on_train_batch_end``: its latency, including the wait for the slowest rank, hides behind
backward and the optimizer step (on CPU processes; on accelerators the collective runs in
``on_train_batch_end``, since packing reads the values on the host). A value logged after the collective
started (``on_after_backward``, ``on_before_optimizer_step``, and also the LightningModule's own
``on_before_backward``, which Lightning calls after the callbacks') cannot be in that collective: the first
logged step of a fit therefore reduces in ``on_train_batch_end``, after every hook, and learns from a flag in
the collective whether any rank logs after backward; if one does, every later step reduces there too (one
blocking collective per step, as if started late). A value first logged after backward in a later step is that
rank's own in that step (with a warning); the next collective tells every rank, and from then on steps reduce
in ``on_train_batch_end`` (that one step pays two collectives).

The collective carries a fixed-size header that lets every rank check, with the same outcome on every
rank, that all ranks logged the same names (same count and a 48-bit digest of the sorted names): a
mismatch raises :class:`MetricMismatchError`, naming the metrics and ranks, on every rank instead of
hanging or adding unrelated values. The body has a capacity agreed by all ranks (64 slots, doubled when a
step needs more: that step pays a second collective, once), so ranks logging different numbers of values
still call the collective with tensors of the same size.

Left alone (Lightning's behaviour): ``torchmetrics.Metric`` objects (their own sync), values logged with
``rank_zero_only=True``, ``sync_dist=True`` values with a ``sync_dist_group``, ``on_step=False`` values,
and values logged in ``on_train_batch_end`` (the averaging runs at the start of that hook, before any
callback reads the metrics; later values are this rank's own, with a warning).

:class:`FusedMetricReducer` is the algorithm and needs no Trainer; :class:`AverageTrainingMetrics` is the
callback the strategy puts first in the Trainer's callbacks; every private Lightning name lives in
``_lightning``.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torchmetrics import Metric

from lightning_shardplus import _lightning

Reduction = Literal["mean", "sum", "max", "min"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min")

_DIGEST_BYTES = 6  # 48 bits; small integers (a byte, its square) stay exact when summed in float64
_FLAG = 3 + 2 * _DIGEST_BYTES  # after: participants, (slots, slots^2), (byte, byte^2) per digest byte
_HEADER = _FLAG + 1  # then the number of ranks that raised the flag
INITIAL_CAPACITY = 64


class MetricMismatchError(RuntimeError):
    """Ranks logged different training metrics in the same step; raised on every rank."""


class _Values:
    """The reduced values of one step (Python floats, float64), turned into one tensor per dtype and device on
    demand, which each metric's step value is a view of."""

    __slots__ = ("floats", "_tensors")

    def __init__(self, floats: list[float]) -> None:
        self.floats = floats
        self._tensors: dict[tuple[torch.dtype, torch.device | str], Tensor] = {}

    def tensor(self, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        tensor = self._tensors.get((dtype, device))
        if tensor is None:
            tensor = self._tensors[(dtype, device)] = torch.tensor(self.floats, dtype=dtype, device=device)
        return tensor


class Reduced:
    """One metric after the collective: its step value, and for means the global sums it came from (over
    ranks, and micro-batches, of weight * value, and of the weights)."""

    __slots__ = ("_index", "_values", "weight", "weighted_sum")

    def __init__(
        self, values: _Values, index: int, weighted_sum: float | None = None, weight: float | None = None
    ) -> None:
        self._values, self._index = values, index
        self.weighted_sum, self.weight = weighted_sum, weight

    @classmethod
    def of(cls, value: float, weighted_sum: float | None = None, weight: float | None = None) -> Reduced:
        return cls(_Values([value]), 0, weighted_sum, weight)

    @property
    def value(self) -> float:
        return self._values.floats[self._index]

    def value_as(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """The step value as a 0-dim tensor (a view of one tensor shared by the step's metrics)."""
        return self._values.tensor(dtype, device)[self._index]

    def __repr__(self) -> str:
        return f"Reduced(value={self.value!r}, weighted_sum={self.weighted_sum!r}, weight={self.weight!r})"


def _max(a: float, b: float) -> float:
    return a if a != a or a >= b else b  # NaN wins, as in torch.maximum


def _min(a: float, b: float) -> float:
    return a if a != a or a <= b else b


def _slots(reduction: str, world_size: int) -> int:
    # max/min: one slot per rank, this rank's value in its own slot (the SUM all_reduce gathers them)
    return 2 if reduction == "mean" else 1 if reduction == "sum" else world_size


def _digest(signature: Sequence[tuple[str, str]]) -> bytes:
    text = "\n".join(f"{key}\t{reduction}" for key, reduction in signature)
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()


@dataclass(frozen=True)
class _Layout:
    """Where each metric of a signature (sorted keys and their reductions) lives in the collective's body."""

    signature: tuple[tuple[str, str], ...]
    header: list[float]  # this rank's header: 1, slots, slots^2, then each digest byte and its square
    slots: int
    position: dict[str, int]  # first body slot of each key
    # with max/min keys: where one slot per rank says that rank contributed (a rank without data does not)
    presence: int | None = None

    @classmethod
    def of(cls, signature: tuple[tuple[str, str], ...], world_size: int) -> _Layout:
        position: dict[str, int] = {}
        slots = 0
        for key, reduction in signature:
            position[key] = slots
            slots += _slots(reduction, world_size)
        presence = None
        if any(reduction in ("max", "min") for _, reduction in signature):
            presence, slots = slots, slots + world_size
        header = [1, slots, slots * slots] + [x for b in _digest(signature) for x in (b, b * b)]
        return cls(signature, [float(x) for x in header], slots, position, presence)


class _Window:
    """What this rank observed between two reductions: every value in order, with its key's reduction and
    label."""

    __slots__ = ("kinds", "keys", "values", "weights")

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, str]] = {}
        self.keys: list[str] = []
        self.values: list[Tensor] = []
        self.weights: list[float] = []

    def signature(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, self.kinds[key][0]) for key in sorted(self.kinds))

    def entries(self) -> list[tuple[str, str, str]]:
        return [(key, *self.kinds[key]) for key in sorted(self.kinds)]

    def floats(self) -> list[float]:
        values = self.values
        if not values:
            return []
        device = values[0].device
        if all(v.device == device for v in values):
            return torch.stack(values).tolist()  # one copy (and one synchronisation on an accelerator)
        return [v.item() for v in values]


@dataclass
class Launched:
    """A reduction started with :meth:`FusedMetricReducer.start`: the window it carries, its buffer and the
    collective's handle."""

    window: _Window
    buffer: Tensor
    work: Any
    abstain: bool = False


class FusedMetricReducer:
    """Collects this rank's scalars and reduces all of them across ranks with one SUM ``all_reduce``.

    The arithmetic around the collective is done on Python floats (float64): for a few scalars that is much
    cheaper than tensor operations, and it moves the values once each way (one synchronisation on an
    accelerator, which reading the result needs anyway). The reduction either blocks (:meth:`reduce`) or is
    started early and finished later (:meth:`start`, :meth:`finish`), so that it overlaps other work.

    Every reduction also sums one flag per rank (``flag=`` of :meth:`pack`): :attr:`flagged_ranks` holds, after
    each reduction, how many ranks raised it. The caller uses it to agree on a decision without a second
    collective.

    Args:
        world_size, rank: this process's place in the group the collective runs over.
        all_reduce: SUM all_reduce of a 1-d float64 tensor over that group, in place; called as
            ``all_reduce(tensor)`` (blocking) or ``all_reduce(tensor, async_op=True)`` (returns a handle with
            ``wait()``).
        all_gather_object: gathers a picklable object from every rank (only used to name a mismatch).
        capacity: body slots of the collective (grows by doubling when a step needs more).
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        all_reduce: Callable[..., Any],
        all_gather_object: Callable[[Any], list[Any]],
        capacity: int = INITIAL_CAPACITY,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.capacity = capacity
        self.flagged_ranks = 0
        self._all_reduce = all_reduce
        self._all_gather_object = all_gather_object
        self._window = _Window()  # every observation since the last reduction (or start)
        self._layout = _Layout.of((), world_size)  # the last one computed

    @property
    def pending(self) -> list[str]:
        return sorted(self._window.kinds)

    def observe(self, key: str, reduction: Reduction, value: Tensor, weight: float = 1.0, label: str = "") -> None:
        """Add one value of ``key`` (a 1-element tensor) with its weight (used by ``"mean"`` only)."""
        window = self._window
        kind = window.kinds.get(key)
        if kind is None:
            if reduction not in REDUCTIONS:
                raise ValueError(f"`reduction`={reduction!r} is not valid: expected one of {REDUCTIONS}.")
            window.kinds[key] = (reduction, label or key)
        elif kind[0] != reduction:
            raise ValueError(f"`{key}` was observed as {kind[0]!r} and now as {reduction!r}.")
        window.keys.append(key)
        window.values.append(value.detach() if value.dim() == 0 else value.detach().reshape(()))
        window.weights.append(float(weight))

    def discard(self) -> None:
        """Forget what was observed since the last reduction (on every rank at the same point)."""
        self._window = _Window()

    def entries(self) -> list[tuple[str, str, str]]:
        """(key, reduction, label) of every metric observed since the last reduction, sorted by key."""
        return self._window.entries()

    # ---------------------------------------------------------------- the collective

    def _layout_of(self, window: _Window) -> _Layout:
        signature = window.signature()
        if self._layout.signature != signature:
            self._layout = _Layout.of(signature, self.world_size)
        return self._layout

    def pack(
        self,
        device: torch.device | str = "cpu",
        flag: bool = False,
        window: _Window | None = None,
        abstain: bool = False,
    ) -> Tensor:
        """This rank's contribution: header (always) and body (when it fits the agreed capacity). ``abstain``: a rank
        without data in this step contributes nothing (zeros): the reductions are over the other ranks."""
        window = window or self._window
        layout = self._layout_of(window)
        if abstain:
            nothing = [0.0] * _FLAG + [float(flag)] + [0.0] * self.capacity
            return torch.tensor(nothing, dtype=torch.float64, device=device)
        numbers = layout.header + [float(flag)] + [0.0] * self.capacity
        if layout.presence is not None and layout.slots <= self.capacity:
            numbers[_HEADER + layout.presence + self.rank] = 1.0
        if window.values and layout.slots <= self.capacity:
            seen: set[int] = set()  # max/min slots holding a value already
            for key, value, weight in zip(window.keys, window.floats(), window.weights, strict=True):
                reduction = window.kinds[key][0]
                slot = _HEADER + layout.position[key]
                if reduction == "mean":
                    numbers[slot] += weight * value
                    numbers[slot + 1] += weight
                elif reduction == "sum":
                    numbers[slot] += value
                else:
                    slot += self.rank
                    if slot not in seen:
                        seen.add(slot)
                        numbers[slot] = value
                    else:
                        numbers[slot] = (_max if reduction == "max" else _min)(numbers[slot], value)
        return torch.tensor(numbers, dtype=torch.float64, device=device)

    def unpack(
        self, buffer: Tensor, where: str = "this step", window: _Window | None = None
    ) -> dict[str, Reduced] | None:
        """Check the summed header and read the reductions; None when the body did not fit (the capacity has
        grown: pack and all_reduce again). Raises :class:`MetricMismatchError` on every rank when the ranks
        differ."""
        window = window or self._window
        numbers = buffer.tolist()
        header = [int(x) for x in numbers[:_HEADER]]  # exact: small integers summed in float64
        world, contributors = self.world_size, header[0]  # ranks without data in this step do not contribute
        if not 0 < contributors <= world:
            raise RuntimeError(
                f"shardplus: the training-metrics collective summed {contributors} contributions, expected 1 to "
                f"{world}."
            )
        self.flagged_ranks = header[_FLAG]
        pairs = [(header[i], header[i + 1]) for i in range(1, _FLAG, 2)]
        if any(contributors * squares != total * total for total, squares in pairs):  # the ranks' numbers differ
            self._raise_mismatch(where, window)
        slots = header[1] // contributors
        if slots > self.capacity:
            self.capacity = 1 << (slots - 1).bit_length()
            return None
        layout = self._layout_of(window)
        floats: list[float] = []
        values = _Values(floats)
        reduced: dict[str, Reduced] = {}
        for key, reduction in layout.signature:
            slot = _HEADER + layout.position[key]
            if reduction == "mean":
                weighted_sum, weight = numbers[slot], numbers[slot + 1]
                floats.append(weighted_sum / weight if weight else math.nan)
                reduced[key] = Reduced(values, len(floats) - 1, weighted_sum, weight)
                continue
            if reduction == "sum":
                floats.append(numbers[slot])
            else:
                per_rank = numbers[slot : slot + world]
                if layout.presence is not None:  # the ranks that contributed
                    present = numbers[_HEADER + layout.presence : _HEADER + layout.presence + world]
                    per_rank = [value for value, here in zip(per_rank, present, strict=True) if here] or [math.nan]
                extreme = per_rank[0]
                for value in per_rank[1:]:
                    extreme = (_max if reduction == "max" else _min)(extreme, value)
                floats.append(extreme)
            reduced[key] = Reduced(values, len(floats) - 1)
        if window is self._window:
            self.discard()
        return reduced

    def reduce(
        self, device: torch.device | str = "cpu", where: str = "this step", flag: bool = False, abstain: bool = False
    ) -> dict[str, Reduced]:
        """Reduce everything observed since the last call, on all ranks; every rank must call it at the same
        step (also with nothing observed; ``abstain``: a rank without data, see :meth:`pack`). One all_reduce, two
        in the step where the capacity grows."""
        return self._complete(self._window, device, where, flag, abstain)

    def start(self, device: torch.device | str = "cpu", flag: bool = False, abstain: bool = False) -> Launched:
        """Start reducing what was observed so far without waiting for it (every rank at the same point, as
        for :meth:`reduce`); later observations go to the next reduction. Complete it with :meth:`finish`."""
        window, self._window = self._window, _Window()
        buffer = self.pack(device, flag, window, abstain)
        return Launched(window, buffer, self._all_reduce(buffer, async_op=True), abstain)

    def finish(
        self, launched: Launched, device: torch.device | str = "cpu", where: str = "this step"
    ) -> dict[str, Reduced]:
        """Wait for a reduction :meth:`start` began and read it (a second, blocking collective in the step
        where the capacity grows)."""
        launched.work.wait()
        reduced = self.unpack(launched.buffer, where, launched.window)
        if reduced is not None:
            return reduced
        return self._complete(launched.window, device, where, bool(self.flagged_ranks), launched.abstain)

    def _complete(
        self, window: _Window, device: torch.device | str, where: str, flag: bool, abstain: bool = False
    ) -> dict[str, Reduced]:
        while True:
            buffer = self.pack(device, flag, window, abstain)
            self._all_reduce(buffer)
            reduced = self.unpack(buffer, where, window)
            if reduced is not None:
                return reduced

    def _raise_mismatch(self, where: str, window: _Window) -> None:
        gathered = self._all_gather_object(window.entries())  # every rank gets here: the header sums are shared
        if window is self._window:
            self.discard()
        raise MetricMismatchError(describe_mismatch(gathered, where))


def describe_mismatch(per_rank: Sequence[Sequence[tuple[str, str, str]]], where: str) -> str:
    """The error text for ranks that logged different metrics: ``per_rank[r]`` lists rank r's (key, reduction,
    label) entries."""
    sets = [set(entries) for entries in per_rank]
    common = set.intersection(*sets) if sets else set()
    differing = sorted(set().union(*sets) - common)
    lines = []
    for key, reduction, label in differing:
        on = [rank for rank, entries in enumerate(sets) if (key, reduction, label) in entries]
        off = [rank for rank in range(len(sets)) if rank not in on]
        lines.append(f"{label} (reduced as {reduction}): logged on rank(s) {on}, not on rank(s) {off}")
    detail = "; ".join(lines) if lines else "the ranks' metric names differ"
    return (
        f"shardplus: ranks logged different training metrics at {where}, so they cannot be averaged without "
        f"mixing unrelated values: {detail}. Log the same names (with the same reduce_fx and sync_dist) on "
        "every rank, log rank-specific values with `rank_zero_only=True`, or set "
        "`average_training_metrics=False`."
    )


def combined_epoch_state(
    reduce_fx: str,
    before: tuple[Tensor, Tensor | None],
    reduced: Reduced,
) -> tuple[Tensor, Tensor | None]:
    """The epoch accumulation after a reduced step: means add the global weighted sum and weight (so the epoch
    value is the batch-weighted mean over all ranks and steps); sum/max/min apply ``reduce_fx`` to the step
    value."""
    value, count = before
    if reduce_fx == "mean":
        assert reduced.weighted_sum is not None and reduced.weight is not None and count is not None
        return value + reduced.weighted_sum, count + round(reduced.weight)
    if reduce_fx == "sum":
        return value + reduced.value, count
    step = torch.tensor(reduced.value, dtype=value.dtype, device=value.device)
    if reduce_fx == "max":
        return torch.maximum(value, step), count
    return torch.minimum(value, step), count


# -------------------------------------------------------------------- Lightning glue


def _all_reduce(tensor: Tensor, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, async_op=async_op)  # looked up at call time: tests/test_metrics.py counts it


def _all_gather_object(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


@dataclass
class _Pending:
    """A metric observed in the current window, and where its step/epoch values go once reduced."""

    logged: _lightning.LoggedValue
    epoch_state_before: tuple[Tensor, Tensor | None] | None  # at its first observation in the window


@dataclass
class _BatchWeight:
    batch: Any = None
    weight: float = 1.0
    known: bool = False


class AverageTrainingMetrics(Callback):
    """Replaces the training values logged on each rank by their cross-rank reduction, with one collective per
    logged step. Added by ``ShardPlusStrategy(average_training_metrics=True)`` as the first callback, so that
    its ``on_train_batch_end`` runs before any other callback (progress bar, checkpointing) reads the
    metrics.

    When nothing is logged after backward begins (the usual case: values come from ``training_step``), the
    collective is started in ``on_before_backward`` and read in ``on_train_batch_end``, so its latency hides
    behind backward and the optimizer step. The first logged step of a fit, and every step once any rank has
    logged a value after backward began (``on_after_backward``, ``on_before_optimizer_step``), reduce in
    ``on_train_batch_end`` instead (blocking), which includes those values; the ranks agree on this through a
    flag carried by the collective itself."""

    def __init__(self) -> None:
        self._reducer: FusedMetricReducer | None = None
        self._restore: Callable[[], None] | None = None
        self._results: Any = None
        self._pending: dict[str, _Pending] = {}  # observed in this step's window before a launch
        self._after_launch: dict[str, _Pending] = {}  # observed after the window was launched
        self._launched: Launched | None = None
        self._backward_began = False  # in this logged step
        self._logged_after_backward = False  # this rank, in this logged step
        self._announce = False  # this rank logged values after a launch, which were not averaged
        self._late_values: bool | None = None  # agreed by all ranks; None: not known yet
        self._last: dict[str, Tensor] = {}  # the last reduced step value of each metric
        self._warned: set[str] = set()
        self._weight = _BatchWeight()
        self._without_data = False  # this rank had no data in a micro-batch of this logged step (uneven inputs)

    def abstain_this_step(self) -> None:
        """This rank has no data in the current micro-batch (``uneven_inputs="join"``): in a logged step where it
        observed nothing, it takes part in the collective without contributing, so the values are the means over
        the ranks that had data."""
        self._without_data = True

    def _abstains(self) -> bool:
        assert self._reducer is not None
        return self._without_data and not self._reducer.pending

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        self._reducer = FusedMetricReducer(trainer.world_size, trainer.global_rank, _all_reduce, _all_gather_object)
        self._results = _lightning.training_results(trainer)
        self._restore = _lightning.intercept_training_logs(self._results, self._take, self._observe)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A batch skipped by `on_train_batch_start` returning -1 ends the epoch before `on_train_batch_end`:
        # what it logged is not carried into the next epoch's first step.
        if self._reducer is not None:
            self._reducer.discard()
            self._clear_step()

    def _take(self, log: _lightning.TrainingLog) -> bool:
        if not log.on_step or not log.is_tensor or log.rank_zero_only:
            return False
        if log.sync_dist and log.sync_dist_group is not None:
            return False  # a sync over a sub-group: Lightning's
        if log.fx == "on_train_batch_end":
            if log.key not in self._warned:
                self._warned.add(log.key)
                rank_zero_warn(
                    f"shardplus: `{log.name}` is logged in `on_train_batch_end`, after the training metrics "
                    "of the batch were averaged across ranks (at the start of that hook, before callbacks "
                    "read them): it is this rank's own value. Log it from `training_step` to average it."
                )
            return False
        return True

    def _observe(self, logged: _lightning.LoggedValue) -> None:
        assert self._reducer is not None
        log = logged.log
        reduction = logged.reduce_fx if log.sync_dist and logged.reduce_fx != "mean" else "mean"
        weight = float(log.batch_size) if log.batch_size is not None else self._batch_weight()
        self._reducer.observe(log.key, reduction, logged.value, weight, label=f"`{log.name}` (from {log.fx})")
        self._logged_after_backward |= self._backward_began
        pending = self._after_launch if self._launched is not None else self._pending
        previous = pending.get(log.key)
        before = previous.epoch_state_before if previous is not None else logged.epoch_state_before
        pending[log.key] = _Pending(logged, before)

    def _batch_weight(self) -> float:
        batch = _lightning.current_batch(self._results)
        if not self._weight.known or self._weight.batch is not batch:
            size = _lightning.batch_size_of_current_batch(self._results)
            self._weight = _BatchWeight(batch, float(size) if size is not None else 1.0, True)
        return self._weight.weight

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._reducer is None or not _lightning.logs_this_step(trainer) or self._backward_began:
            return
        self._backward_began = True
        # Packing reads the values on the host: on an accelerator that would wait for the forward pass before
        # backward is queued, so there the collective stays in `on_train_batch_end` (which must read them anyway).
        if self._late_values is False and trainer.strategy.root_device.type == "cpu":
            self._launched = self._reducer.start(trainer.strategy.root_device, self._announce, self._abstains())
            self._announce = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._reducer is None:
            return
        self._weight = _BatchWeight()
        if not _lightning.logs_this_step(trainer):
            # inside an accumulation window: show the previous step's values until this window is reduced
            for key, pending in self._pending.items():
                _lightning.set_step_value(pending.logged.metric, self._last.get(key))
            return
        where = f"epoch {trainer.current_epoch}, batch {batch_idx}"
        device = trainer.strategy.root_device
        try:
            if self._launched is None:
                flag = self._logged_after_backward or self._announce
                self._announce = False
                self._apply(self._pending, self._reducer.reduce(device, where, flag, self._abstains()))
                if self._late_values is None:
                    self._late_values = self._reducer.flagged_ranks > 0
                return
            applied = self._apply(self._pending, self._reducer.finish(self._launched, device, where))
            if self._reducer.flagged_ranks:
                # a rank logged after backward in an earlier step: from now on every step reduces in this hook
                self._late_values = True
                self._apply(self._after_launch, self._reducer.reduce(device, where, abstain=self._abstains()), applied)
            elif self._after_launch:
                self._warn_not_averaged(self._after_launch)
                self._announce = True  # the next collective tells every rank
                self._reducer.discard()
        finally:
            self._clear_step()

    def _apply(
        self,
        pending: dict[str, _Pending],
        reduced: dict[str, Reduced],
        applied: dict[str, tuple[Tensor, Tensor | None]] | None = None,
    ) -> dict[str, tuple[Tensor, Tensor | None]]:
        """Write the reduced values as the step values (and into the epoch state); returns the epoch states
        written, so that values of the same key reduced later in the step build on them."""
        written: dict[str, tuple[Tensor, Tensor | None]] = {}
        for key, entry in pending.items():
            logged = entry.logged
            local = logged.value
            step = reduced[key].value_as(local.dtype, local.device)
            if local.dim():
                step = step.reshape(local.shape)
            _lightning.set_step_value(logged.metric, step)
            self._last[key] = step
            before = applied[key] if applied and key in applied else entry.epoch_state_before
            if before is not None:
                written[key] = combined_epoch_state(logged.reduce_fx, before, reduced[key])
                _lightning.set_epoch_state(logged.metric, *written[key])
        return written

    def _warn_not_averaged(self, pending: dict[str, _Pending]) -> None:
        names = [entry.logged.log.name for entry in pending.values()]
        warnings.warn(  # on the ranks concerned
            f"shardplus: {names} were logged after backward began, once the step's training metrics had been "
            "sent: in this step they are this rank's own values; from the next step on, every step's values "
            "are averaged in `on_train_batch_end` instead.",
            stacklevel=2,
        )

    def _clear_step(self, wait: bool = True) -> None:
        if self._launched is not None and wait:
            self._launched.work.wait()  # a started collective is not abandoned half-way
        self._launched = None
        self._pending.clear()
        self._after_launch.clear()
        self._backward_began = self._logged_after_backward = self._without_data = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._restore is not None:
            self._restore()
        self._restore = self._reducer = self._results = None
        # not waiting for a collective still in flight: after an exception a peer may be gone (it ends with the
        # process group)
        self._clear_step(wait=False)
        self._last.clear()
        self._announce = False
        self._late_values = None
        self._weight = _BatchWeight()


# ====================================================================================================
# Exact evaluation
# ====================================================================================================

# Where evaluation values are logged per batch; values logged in epoch-level hooks keep Lightning's handling.
_PER_BATCH_FX = frozenset(
    f"{prefix}{fx}"
    for prefix in ("", "on_")
    for fx in (
        "validation_step",
        "test_step",
        "validation_batch_start",
        "validation_batch_end",
        "test_batch_start",
        "test_batch_end",
    )
)

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
    if reduction == "sum":
        return values.sum()
    if reduction == "max":
        return values.max()
    if reduction == "min":
        return values.min()
    raise ValueError(f"unknown reduction {reduction!r}")


def describe(key: str, result_metric: Any) -> dict[str, Any]:
    """What another rank needs to register the same logged key (picklable, no tensors)."""
    meta = result_metric.meta
    return {
        "key": key,
        "fx": meta.fx.split(".")[0],
        "name": meta.name,
        "reduction": reduction_of(meta, result_metric.is_tensor),
        "prog_bar": meta.prog_bar,
        "logger": meta.logger,
        "on_step": meta.on_step,
        "sync_dist": meta.sync.should,
        "dataloader_idx": meta.dataloader_idx,
        "add_dataloader_idx": meta.add_dataloader_idx,
        "metric_attribute": meta.metric_attribute,
    }


def _exactly_reduced(key: str, result_metric: Any) -> bool:
    return result_metric.meta.fx.split(".")[0] in _PER_BATCH_FX and not result_metric.meta.sync.rank_zero_only


class ExactEvaluation(Callback):
    """Wires exact evaluation into Lightning: added by ``ShardPlusStrategy(exact_evaluation=True)`` when more
    than one process runs.

    From the start of an evaluation run until its epoch end it is :attr:`deferring`: the strategy's ``reduce`` does
    not communicate then (Lightning's per-value ``sync_dist`` would be a per-batch collective), and torchmetrics
    ``Metric`` modules do not sync; at the epoch end every rank joins one reduction of all logged values, then the
    Metrics' own sync. Lightning reads the epoch values before that and advises ``sync_dist=True`` for values
    logged without it: the advice is silenced for the values reduced here, during the evaluation run only.
    """

    def __init__(self) -> None:
        self.deferring = False
        self._metric_flags: dict[Metric, tuple[bool, bool]] = {}
        self._silenced: set[str] = set()  # names whose sync_dist advice is ignored until `_close`
        self._restore_warnings: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ window

    def _open(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.deferring = True
        for metric in pl_module.modules():
            if isinstance(metric, Metric):
                self._metric_flags[metric] = (metric.sync_on_compute, metric.dist_sync_on_step)
                metric.sync_on_compute = metric.dist_sync_on_step = False

    def _close(self, trainer: pl.Trainer) -> None:
        self.deferring = False
        for restore in self._restore_warnings:
            restore()
        self._restore_warnings.clear()
        self._silenced.clear()
        for metric, (sync_on_compute, dist_sync_on_step) in self._metric_flags.items():
            metric.sync_on_compute, metric.dist_sync_on_step = sync_on_compute, dist_sync_on_step
            # torchmetrics copies `sync_on_compute` into `_to_sync` on each update: a `compute()` the user calls
            # before the next update must sync again.
            metric._to_sync = sync_on_compute
        self._metric_flags.clear()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open(trainer, pl_module)

    on_test_start = on_validation_start

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # before Lightning reads the epoch values (after the last batch of each loader)
        results = _lightning.active_results(trainer)
        names = {
            rm.meta.name for key, rm in _lightning.epoch_result_metrics(results).items() if _exactly_reduced(key, rm)
        }
        if new := names - self._silenced:
            self._restore_warnings.append(_lightning.silence_epoch_sync_advice(new))
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

    # ------------------------------------------------------------------ the reduction

    def reduce_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank: agree on the logged keys, register the ones this rank lacks, then reduce the running
        values in one all_gather and the torchmetrics Metrics with their own sync, in key order."""
        results = _lightning.active_results(trainer)
        local = {
            key: describe(key, rm)
            for key, rm in _lightning.epoch_result_metrics(results).items()
            if _exactly_reduced(key, rm)
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        entries = dict(sorted({k: v for rank_entries in gathered for k, v in rank_entries.items()}.items()))
        if not entries:
            return
        device = trainer.strategy.root_device
        result_metrics = {}
        for key, entry in entries.items():
            result_metrics[key] = results[key] if key in local else self._register(results, entry, pl_module, trainer)

        tensor_keys = [key for key, entry in entries.items() if entry["reduction"] != "metric"]
        if tensor_keys:
            local_values = torch.stack(
                [
                    torch.stack(
                        [
                            result_metrics[key].value.double(),
                            getattr(result_metrics[key], "cumulated_batch_size", torch.tensor(0)).double(),
                        ]
                    )
                    for key in tensor_keys
                ]
            ).to(device)
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
                with metric.sync_context(should_sync=True, should_unsync=True):
                    value = type(metric).compute(metric)
                _lightning.set_computed(result_metrics[key], torch.as_tensor(value))

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
