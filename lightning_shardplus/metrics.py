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
logged step (an optimizer step; every batch in manual optimization), replaced by its reduction over all
ranks, at the start of ``on_train_batch_end``:

- plain values (and ``sync_dist=True`` values with ``reduce_fx="mean"``): the mean over ranks weighted by
  batch size: ``self.log(..., batch_size=...)`` where given, else the size Lightning infers from the batch
  (as it does for epoch means), else 1; with gradient accumulation, over every micro-batch of the step;
- ``sync_dist=True`` values with ``reduce_fx`` ``"sum"``, ``"max"`` or ``"min"``: that reduction over
  ranks, as Lightning's own sync would compute it (Lightning's sync is skipped).

The values stay on the device: they are packed into one buffer (one ``index_add`` onto a cached constant, at
positions cached per set of logged names), reduced by ONE SUM, plus one MAX ``all_reduce`` of 2 slots per
max/min name in steps whose agreed layout has max/min names (min as the max of the negation), and written back
as device tensors: nothing is read on the host during the step, the loggers and the progress bar convert the
values when they read them. Sizes do not grow with the world size. Where no hook that runs after backward starts
can log (automatic optimization, no such hook overridden: :func:`logs_only_before_backward`), the SUM buffer is
packed in the last micro-batch's ``on_before_backward`` and reduced during backward: inside DDP's gradient
all-reduce when the strategy gives a carrier (:mod:`lightning_shardplus.carrier`; float32 there), else by an
all_reduce of its own started there (float64); ``on_train_batch_end`` then reads the result.

Agreement without a host read: the SUM buffer starts with a header of 0/1 flags (1 from each contributing rank,
the bits of the body's slots, of the max/min slots and of a 48-bit digest of the sorted names and reductions):
the ranks logged the same names exactly when every summed flag is 0 or the number of contributors (sums that
stay exact through DDP's float32 average). The summed headers are kept on the device and read on the host (one
synchronisation for all of them) when the loggers read the values anyway (Lightning's logging steps), at
the end of each training epoch and after 128 unchecked steps: a mismatch raises
:class:`MetricMismatchError`, naming the first step where the ranks differed, the metrics and ranks, on
every rank. The buffer sizes are agreed by every rank (64 body slots, doubled when needed; the max/min
slots set from the checked headers): a rank whose names need more than agreed reads this step's header
(a synchronisation, once per new layout); the ranks that logged the same names all need the same and
grow together (a second collective in that step), a mismatched rank grows nothing, so no collective ever
differs in size.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor
from torchmetrics import Metric

from lightning_shardplus import _lightning

Reduction = Literal["mean", "sum", "max", "min"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min")

_DIGEST_BYTES = 6  # 48 bits
_COUNT_BITS = 16  # slot counts as bits: at most 2**16 - 1 SUM (or MAX) slots per step
# header, one 0/1 per slot (sums of 0/1 over ranks stay exact through DDP's float32 average, see `_parse`):
# contributors, then the bits of the SUM slots, of the MAX slots and of a digest of the names and reductions
_HEADER = 1 + 2 * _COUNT_BITS + 8 * _DIGEST_BYTES
INITIAL_CAPACITY = 64
# the SUM buffer's size while the capacity is the initial one (with the slot for a carried count): what a
# `GradientCarrier` (carrier.py) holds when the buffer rides in DDP's gradient all-reduce
CARRIED_NUMEL = _HEADER + INITIAL_CAPACITY + 1
UNCHECKED_STEPS = 128  # at most this many reduced steps between two host checks of the headers
_PLANS = 256  # cached observation orders, at most
_F64 = torch.float64


class MetricMismatchError(RuntimeError):
    """Ranks logged different training metrics in the same step; raised on every rank."""


class _Values:
    """The reduced values of one step: one device tensor (means, sums, then max/min values, in layout order; 0-dim
    for a step of a single mean) converted once per dtype and device, which each metric's step value is a view of;
    for means also the global weighted sums and weights: (weighted sum, weight) per mean in ``sums[start:stop]``,
    sliced only when asked for (epoch means)."""

    __slots__ = ("vector", "_sums", "_start", "_stop", "_tensors")

    def __init__(self, vector: Tensor, sums: Tensor | None = None, start: int = 0, stop: int = 0) -> None:
        self.vector, self._sums, self._start, self._stop = vector, sums, start, stop
        self._tensors: dict[tuple[torch.dtype, torch.device | str], Tensor] = {}

    @property
    def weighted(self) -> Tensor | None:
        return None if self._sums is None else self._sums[self._start : self._stop : 2]

    @property
    def weights(self) -> Tensor | None:
        return None if self._sums is None else self._sums[self._start + 1 : self._stop : 2]

    def tensor(self, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        vector = self.vector
        if dtype == vector.dtype and device == vector.device:
            return vector
        tensor = self._tensors.get((dtype, device))
        if tensor is None:
            tensor = self._tensors[(dtype, device)] = self.vector.to(dtype=dtype, device=device)
        return tensor


class Reduced:
    """One metric after the collective: its step value, and for means the global sums it came from (over
    ranks, and micro-batches, of weight * value, and of the weights), all as device tensors."""

    __slots__ = ("_index", "_values")

    def __init__(self, values: _Values, index: int) -> None:
        self._values, self._index = values, index

    @classmethod
    def of(cls, value: float, weighted_sum: float | None = None, weight: float | None = None) -> Reduced:
        means = weighted_sum is not None and weight is not None
        sums = torch.tensor([weighted_sum, weight], dtype=_F64) if means else None
        return cls(_Values(torch.tensor([value], dtype=_F64), sums, 0, 2), 0)

    @property
    def weighted_sum(self) -> Tensor | None:
        weighted = self._values.weighted
        return None if weighted is None else weighted[self._index]

    @property
    def weight(self) -> Tensor | None:
        weights = self._values.weights
        return None if weights is None else weights[self._index]

    @property
    def value(self) -> float:
        """The step value as a Python float: a host read (for callers outside the training step)."""
        vector = self._values.vector
        return (vector[self._index] if vector.dim() else vector).item()

    def value_as(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """The step value as a 0-dim tensor (a view of one tensor shared by the step's metrics)."""
        values = self._values.tensor(dtype, device)
        return values[self._index] if values.dim() else values

    def __repr__(self) -> str:
        return f"Reduced(value={self.value!r})"


def _digest(signature: Sequence[tuple[str, str]]) -> bytes:
    text = "\n".join(f"{key}\t{reduction}" for key, reduction in signature)
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()


def _bits(n: int, width: int) -> list[int]:
    return [(n >> i) & 1 for i in range(width)]


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class _Layout:
    """Where each metric of a signature (sorted keys and their reductions) lives: means (weighted sum, weight),
    then sums in the SUM body; max/min (value, NaN flag) in the MAX buffer; ``index``: its place in the step's
    value vector."""

    signature: tuple[tuple[str, str], ...]
    header: list[float]  # this rank's header: 1, the bits of slots, of extremes and of the digest
    means: int
    sums: int
    extremes: int  # MAX slots: 2 per max/min key
    index: dict[str, int]
    extreme_signs: tuple[float, ...]  # +1 per max key, -1 per min key, in layout order

    @property
    def slots(self) -> int:
        return 2 * self.means + self.sums

    @classmethod
    def of(cls, signature: tuple[tuple[str, str], ...]) -> _Layout:
        groups: dict[str, list[str]] = {"mean": [], "sum": [], "extreme": []}
        for key, reduction in signature:
            groups[reduction if reduction in ("mean", "sum") else "extreme"].append(key)
        ordered = groups["mean"] + groups["sum"] + groups["extreme"]
        kinds = dict(signature)
        signs = tuple(1.0 if kinds[key] == "max" else -1.0 for key in groups["extreme"])
        means, sums, extremes = len(groups["mean"]), len(groups["sum"]), 2 * len(groups["extreme"])
        slots = 2 * means + sums
        if max(slots, extremes) >= 1 << _COUNT_BITS:
            raise ValueError(f"shardplus: {len(signature)} training metrics in one step: too many to average.")
        digest = int.from_bytes(_digest(signature), "little")
        header = [1, *_bits(slots, _COUNT_BITS), *_bits(extremes, _COUNT_BITS), *_bits(digest, 8 * _DIGEST_BYTES)]
        index = {key: i for i, key in enumerate(ordered)}
        return cls(signature, [float(x) for x in header], means, sums, extremes, index, signs)

    def body_slot(self, key: str) -> int:
        i = self.index[key]
        return 2 * i if i < self.means else self.means + i

    def extreme_slot(self, key: str) -> int:
        return 2 * (self.index[key] - self.means - self.sums)


@dataclass(frozen=True)
class _Plan:
    """The device index tensors that put one observation order (the keys in the order they were logged) into
    the buffers; cached, so a step with the same order builds none."""

    layout: _Layout
    weight_slots: tuple[int, ...]  # each mean observation's weight slot in the SUM buffer
    value_index: Tensor  # each mean/sum observation's value slot in the SUM buffer
    summed: Tensor | None  # the mean/sum observations among all (None: all of them)
    extreme_obs: Tensor | None  # the max/min observations (None: none)
    extreme_index: Tensor | None  # their value slots, then their NaN-flag slots in the MAX buffer
    extreme_sign: Tensor | None  # +1 (max) or -1 (min) per max/min observation
    key_sign: Tensor | None  # +1 or -1 per max/min key, in layout order

    @classmethod
    def of(cls, order: tuple[tuple[str, str], ...], layout: _Layout, device: torch.device) -> _Plan:
        weight_slots, value_slots, summed, extreme_obs, extreme_slots, signs = [], [], [], [], [], []
        for i, (key, reduction) in enumerate(order):
            if reduction in ("mean", "sum"):
                slot = _HEADER + layout.body_slot(key)
                value_slots.append(slot)
                summed.append(i)
                if reduction == "mean":
                    weight_slots.append(slot + 1)
            else:
                extreme_obs.append(i)
                extreme_slots.append(layout.extreme_slot(key))
                signs.append(1.0 if reduction == "max" else -1.0)

        def on_device(numbers: list[Any], dtype: torch.dtype = torch.long) -> Tensor:
            return torch.tensor(numbers, dtype=dtype, device=device)

        extremes = bool(extreme_obs)
        return cls(
            layout,
            tuple(weight_slots),
            on_device(value_slots),
            on_device(summed) if extremes else None,
            on_device(extreme_obs) if extremes else None,
            on_device(extreme_slots + [slot + 1 for slot in extreme_slots]) if extremes else None,
            on_device(signs, _F64) if extremes else None,
            on_device(list(layout.extreme_signs), _F64) if layout.extremes else None,
        )


class _Window:
    """What this rank observed between two reductions, in order: (key, reduction), the value (a 0-dim device
    tensor), and the host-known weights (mean observations) and coefficients (mean/sum observations: the
    weight, or 1)."""

    __slots__ = ("kinds", "order", "values", "weights", "coefs", "_stacked")

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, str]] = {}
        self.order: list[tuple[str, str]] = []
        self.values: list[Tensor] = []
        self.weights: list[float] = []
        self.coefs: list[float] = []
        self._stacked: Tensor | None = None

    def signature(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, self.kinds[key][0]) for key in sorted(self.kinds))

    def entries(self) -> list[tuple[str, str, str]]:
        return [(key, *self.kinds[key]) for key in sorted(self.kinds)]

    def stacked(self) -> Tensor:
        if self._stacked is None:  # one copy on the device; none for one value
            values = self.values
            self._stacked = values[0].reshape(1) if len(values) == 1 else torch.stack(values)
        return self._stacked


class Carrier(Protocol):
    """Carries a buffer in DDP's gradient all-reduce (:class:`lightning_shardplus.carrier.GradientCarrier`)."""

    numel: int
    dtype: torch.dtype

    def load(self, buffer: Tensor) -> None: ...

    def unload(self) -> None: ...

    def average(self) -> Tensor | None: ...


@dataclass(frozen=True)
class _Started:
    """A step's SUM buffer whose all_reduce is running (``work``: its handle, None when it already completed), or
    that rides in the step's gradient all-reduce (``carried_by_ddp``; then not kept here: ``summed`` is None)."""

    summed: Tensor | None
    work: Any
    abstain: bool
    carried: float
    carried_by_ddp: bool = False


class FusedMetricReducer:
    """Collects this rank's scalars and reduces all of them across ranks with one SUM ``all_reduce`` (plus one
    MAX ``all_reduce`` when max/min values are logged), on the device, without reading them on the host.

    Every step's summed header is kept on the device; :meth:`check` reads them (one synchronisation) and raises
    :class:`MetricMismatchError` on every rank if the ranks logged different metrics in any of them.
    :meth:`pack`, :meth:`pack_extremes` and :meth:`unpack` are one checked step, in parts (the collectives
    done by the caller).

    Args:
        world_size, rank: this process's place in the group the collectives run over.
        all_reduce: ``all_reduce(tensor, op=dist.ReduceOp.SUM | MAX, async_op=False)`` of a 1-d float64 tensor over
            that group, in place; with ``async_op=True`` it returns a handle with ``wait()`` (or None when done).
        all_gather_object: gathers a picklable object from every rank (only used to name a mismatch).
        capacity: SUM body slots (2 per mean, 1 per sum; grows by doubling when a step needs more).
        extremes: MAX slots (2 per max/min name); 0: no MAX collective until a step needs one.
        device: where the buffers live (the values' device).
        carries: the SUM buffer ends with one more slot, summed with the step: ``start(carried=...)`` puts a
            number there, :attr:`carried_total` is its sum over ranks after :meth:`finish` (uneven inputs' "how
            many ranks have a next batch", so that it needs no collective of its own).
        carrier: where given, :meth:`start` hands the SUM buffer to it instead of starting an all_reduce, while
            the buffer has the carrier's size (:data:`CARRIED_NUMEL`: the initial capacity): DDP then sums it in
            the gradient all-reduce of the backward that follows. A step with no such backward, or a larger agreed
            capacity, falls back to the all_reduce (the same on every rank).
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        all_reduce: Callable[..., Any],
        all_gather_object: Callable[[Any], list[Any]],
        capacity: int = INITIAL_CAPACITY,
        extremes: int = 0,
        device: torch.device | str = "cpu",
        carries: bool = False,
        carrier: Carrier | None = None,
    ) -> None:
        self.world_size = world_size
        self.carries = carries
        # a last SUM slot for a number another component sums with the step (always there with a carrier)
        self.carry_slots = int(carries or carrier is not None)
        self._carrier = carrier
        # the SUM buffer's type: float64, or the carrier's (float32 in a float32 model: its sums of 0/1 flags stay
        # exact; its values get float32's precision, a sum after DDP's division by the world size included)
        self.dtype = carrier.dtype if carrier is not None else _F64
        self.rank = rank
        self.capacity = capacity
        self.extremes = extremes
        self.device = torch.device(device)
        self._all_reduce = all_reduce
        self._all_gather_object = all_gather_object
        self._window = _Window()  # every observation since the last reduction
        self._layouts: dict[tuple[tuple[str, str], ...], _Layout] = {}
        self._plans: dict[tuple[tuple[str, str], ...], _Plan] = {}
        self._identity: Tensor | None = None  # the MAX buffer's identity (-inf values, 0 NaN flags)
        self._unchecked: list[Tensor] = []  # summed headers of the steps since the last check (device)
        self._wheres: list[str] = []
        self._history: list[tuple[int, list[tuple[str, str, str]]]] = []  # (step, entries) at each change
        self._layout: _Layout | None = None  # this rank's in the last step
        self._followed: _Layout | None = None  # this rank's in its last step with values: see `follows`
        self._started: _Started | None = None  # the SUM collective `start` began, until `finish`
        # the last step's plan, key, header and weights, and coefficients (a tensor, or one number for all)
        self._constants: tuple[_Plan, Any, Tensor, Tensor | float] | None = None
        self.carried_total: Tensor | None = None  # the last finished step's carried number, summed over ranks

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
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        if value.device != self.device:
            value = value.to(self.device, non_blocking=True)
        window.order.append((key, reduction))
        window.values.append(value)
        if reduction == "mean":
            window.weights.append(float(weight))
            window.coefs.append(float(weight))
        elif reduction == "sum":
            window.coefs.append(1.0)

    def discard(self) -> None:
        """Forget what was observed since the last reduction, and a started reduction (on every rank at the same
        point)."""
        if self._started is not None and self._started.work is not None:
            self._started.work.wait()  # every rank issued it: let it complete before its buffer is dropped
        if self._carrier is not None:
            self._carrier.unload()
        self._started = None
        self._window = _Window()

    @property
    def started(self) -> bool:
        """Whether :meth:`start` began a reduction that :meth:`finish` has not completed."""
        return self._started is not None

    def entries(self) -> list[tuple[str, str, str]]:
        """(key, reduction, label) of every metric observed since the last reduction, sorted by key."""
        return self._window.entries()

    # ---------------------------------------------------------------- packing (device only)

    def _plan(self, window: _Window) -> _Plan:
        order = tuple(window.order)
        plan = self._plans.get(order)
        return plan if plan is not None else self._new_plan(order, window.signature())

    def _new_plan(self, order: tuple[tuple[str, str], ...], signature: tuple[tuple[str, str], ...]) -> _Plan:
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = _Layout.of(signature)
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        plan = self._plans[order] = _Plan.of(order, layout, self.device)
        return plan

    def _host_numbers(self, numbers: list[float]) -> Tensor:
        """Host-known numbers on the device without waiting for it (a pinned, non-blocking copy on CUDA)."""
        if self.device.type == "cuda":
            return torch.tensor(numbers, dtype=self.dtype, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(numbers, dtype=self.dtype, device=self.device)

    def pack(self, abstain: bool = False, carried: float = 0.0) -> Tensor:
        """This rank's SUM contribution: header (always) and body (when it fits the agreed capacity), then the
        carried number if the reducer ``carries``. ``abstain``: a rank without data in this step contributes nothing
        (zeros): the reductions are over the other ranks."""
        scale = self._scale()
        buffer = self._pack(abstain, scale)
        if self.carries:
            buffer[-1] = carried * scale
        return buffer

    def _rides_in_ddp(self) -> bool:
        """Whether this step's SUM buffer goes to the carrier: there is one, and the buffer has its size (the
        initial capacity; a larger agreed capacity takes an all_reduce of its own)."""
        carrier = self._carrier
        return carrier is not None and _HEADER + self.capacity + self.carry_slots == carrier.numel

    def _scale(self) -> float:
        """What this step's buffer is multiplied by: the world size where it rides in DDP's gradient all-reduce,
        which averages (the average of the scaled buffers is the sum), else 1."""
        return float(self.world_size) if self._rides_in_ddp() else 1.0

    def _pack(self, abstain: bool, scale: float) -> Tensor:
        window = self._window
        if abstain:
            return torch.zeros(_HEADER + self.capacity + self.carry_slots, dtype=self.dtype, device=self.device)
        plan = self._plan(window)
        layout = plan.layout
        tail = [0.0] * self.carry_slots
        if layout.slots > self.capacity:  # the header alone: the ranks agree on a larger capacity first
            return self._host_numbers([x * scale for x in layout.header] + [0.0] * self.capacity + tail)
        # a step that repeats the last one (same names, order and weights) reuses its constants
        key = (self.capacity, scale, tuple(window.coefs))
        if self._constants is None or self._constants[0] is not plan or self._constants[1] != key:
            numbers = layout.header + [0.0] * self.capacity + tail
            for slot, weight in zip(plan.weight_slots, window.weights, strict=True):
                numbers[slot] += weight
            coefs = [c * scale for c in window.coefs]
            # the buffer's header and weights; each mean/sum coefficient, as one number where they are equal
            factor = coefs[0] if len(set(coefs)) == 1 else self._host_numbers(coefs)
            self._constants = (plan, key, self._host_numbers([x * scale for x in numbers]), factor)
        _, _, constants, factor = self._constants
        if not window.coefs:
            return constants.clone()
        values = window.stacked()
        if plan.summed is not None:
            values = values.index_select(0, plan.summed)
        if values.dtype != constants.dtype:  # a float64 value in a float32 (carried) buffer, or a 16-bit one
            values = values.to(constants.dtype)
        if isinstance(factor, Tensor):
            return torch.index_add(constants, 0, plan.value_index, values * factor)
        return torch.index_add(constants, 0, plan.value_index, values, alpha=factor)

    def pack_extremes(self, abstain: bool = False) -> Tensor | None:
        """This rank's MAX contribution at the agreed size (None when it is 0): per max/min name the value (negated
        for min; NaN as -inf) and a NaN flag; the identity (-inf, 0) where this rank has nothing or it does not
        fit."""
        if not self.extremes:
            return None
        if self._identity is None or self._identity.numel() != self.extremes:
            identity = [float("-inf"), 0.0] * (self.extremes // 2)
            self._identity = torch.tensor(identity, dtype=_F64, device=self.device)
        buffer = self._identity.clone()
        window = self._window
        plan = self._plan(window)
        if abstain or plan.extreme_obs is None or plan.layout.extremes > self.extremes:
            return buffer
        signed = window.stacked().index_select(0, plan.extreme_obs) * plan.extreme_sign
        infinity = float("inf")
        finite = signed.nan_to_num(nan=-infinity, posinf=infinity, neginf=-infinity)
        source = torch.cat((finite, signed.isnan().to(_F64)))
        return buffer.scatter_reduce_(0, plan.extreme_index, source, "amax")

    def _values(self, plan: _Plan, summed: Tensor, maxed: Tensor | None) -> dict[str, Reduced]:
        """The step's reductions, computed on the device from the summed (and maxed) buffers."""
        layout = plan.layout
        # only where the ranks' names differ (they do not fit): `check` raises
        if layout.slots > summed.numel() - _HEADER - self.carry_slots:
            summed = torch.full((_HEADER + layout.slots,), float("nan"), dtype=self.dtype, device=self.device)
        means = 2 * layout.means
        pairs = (summed, _HEADER, _HEADER + means) if means else ()  # (weighted sum, weight) per mean
        if layout.means == 1 and not layout.sums and not layout.extremes:  # one value: one 0-dim division
            value = torch.div(summed[_HEADER], summed[_HEADER + 1])
            return {key: Reduced(_Values(value, *pairs), 0) for key in layout.index}
        parts = []
        if means:  # a zero total weight gives NaN
            parts.append(torch.div(summed[_HEADER : _HEADER + means : 2], summed[_HEADER + 1 : _HEADER + means : 2]))
        if layout.sums:
            parts.append(summed.narrow(0, _HEADER + means, layout.sums))
        if layout.extremes:
            if maxed is None or maxed.numel() < layout.extremes:  # likewise
                maxed = torch.full((layout.extremes,), float("nan"), dtype=_F64, device=self.device)
            values = maxed[0 : layout.extremes : 2] * plan.key_sign
            parts.append(torch.where(maxed[1 : layout.extremes : 2] > 0, float("nan"), values))
        vector = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else summed.narrow(0, _HEADER, 0)
        shared = _Values(vector, *pairs)
        return {key: Reduced(shared, i) for key, i in layout.index.items()}

    # ---------------------------------------------------------------- the step

    def start(self, abstain: bool = False, carried: float = 0.0) -> None:
        """Start the step's SUM all_reduce without waiting for it, so that it runs while the caller goes on
        (backward); :meth:`finish` completes the step. Every rank calls both at the same step (also with nothing
        observed; ``abstain``: a rank without data, see :meth:`pack`). Nothing may be observed in between."""
        if self._started is not None:
            raise RuntimeError("shardplus: a training-metrics reduction was started twice without `finish`.")
        summed = self.pack(abstain, carried)
        if self._rides_in_ddp():
            assert self._carrier is not None
            self._carrier.load(summed)
            # not kept: the backward that takes it as the carrier's gradient then owns it, and autograd stores it as
            # the gradient as it is (a buffer referenced elsewhere would be copied in every backward)
            self._started = _Started(None, None, abstain, carried, carried_by_ddp=True)
            return
        work = self._all_reduce(summed, op=dist.ReduceOp.SUM, async_op=True)
        self._started = _Started(summed, work, abstain, carried)

    def finish(self, where: str = "this step", check: bool = False) -> dict[str, Reduced]:
        """Wait for the SUM all_reduce :meth:`start` began and return the step's reductions, on the device; with
        ``check`` (the same on every rank) :meth:`check` runs first. One SUM all_reduce in all, plus one MAX
        all_reduce while the agreed layout has max/min values, and one more SUM where the capacity grows.

        A rank that abstained gets the reductions of the names it logged in its last step with values, when the
        ranks with data logged exactly those names this step (read from the header it reads anyway), so that its
        step and epoch values stay those of the other ranks; else none."""
        started, self._started = self._started, None
        if started is None:
            raise RuntimeError("shardplus: `finish` without `start`.")
        summed = started.summed
        if started.carried_by_ddp:
            assert self._carrier is not None
            summed = self._carrier.average()  # of buffers scaled by the world size: the sum
            if summed is None:  # no backward in this step (on every rank, or DDP would have failed): our own
                summed = self.pack(started.abstain, started.carried).div_(self.world_size)  # the same buffer again
                self._all_reduce(summed, op=dist.ReduceOp.SUM)
        elif started.work is not None:
            started.work.wait()  # on CUDA (NCCL) the current stream waits, not the host
        assert summed is not None
        window, abstain = self._window, started.abstain
        plan = self._plan(window)
        layout = plan.layout
        if layout is not self._layout:  # this rank's names changed: remembered to name a mismatch
            self._history.append((len(self._unchecked), window.entries()))
            self._layout = layout
        if abstain or layout.slots > self.capacity or layout.extremes > self.extremes:
            summed, header = self._agree(summed, abstain, started.carried)
            if abstain and self._followed is not None and self._followed_by(header):
                signature = self._followed.signature
                plan = self._plans.get(signature) or self._new_plan(signature, signature)
        if window.order and not abstain:
            self._followed = layout
        if self.carries:
            self.carried_total = summed[-1]
        self._unchecked.append(summed)  # its header is narrowed out when checked
        self._wheres.append(where)
        if check or len(self._unchecked) >= UNCHECKED_STEPS:
            self.check()  # before the MAX collective: sized for this step, none if it has no max/min value
        maxed = self.pack_extremes(abstain)
        if maxed is not None:
            self._all_reduce(maxed, op=dist.ReduceOp.MAX)
        reduced = self._values(plan, summed, maxed)
        self.discard()
        return reduced

    def _agree(self, summed: Tensor, abstain: bool, carried: float = 0.0) -> tuple[Tensor, list[int]]:
        """Read this step's summed header on the host: when all ranks logged the same names (then every one of
        them needs the same sizes and is here, as is every rank without data), adopt the sizes they need,
        reducing again if the body did not fit. A mismatch changes nothing here: :meth:`check` raises it.
        Returns the summed buffer and its header."""
        header = self._parse(summed[:_HEADER].tolist())
        if not _same_everywhere(header):
            return summed, header
        slots, extremes = _counts(header)
        self.extremes = max(self.extremes, _power_of_two(extremes))
        if slots <= self.capacity:
            return summed, header
        self.capacity = _power_of_two(slots)
        summed = self.pack(abstain, carried)
        self._all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed, header

    def _followed_by(self, header: list[int]) -> bool:
        """Whether every rank that contributed to ``header`` logged the names of :attr:`_followed`."""
        assert self._followed is not None
        return header == [header[0] * int(x) for x in self._followed.header]

    def check(self) -> None:
        """Read the summed headers of the steps since the last check on the host (one synchronisation) and raise
        :class:`MetricMismatchError` naming the first step where the ranks logged different metrics; the MAX
        buffer takes the size the last of them needed (0: no MAX collective). Every rank calls it at the same
        step (the headers are the same on every rank, so is the outcome)."""
        if not self._unchecked:
            return
        unchecked = self._unchecked
        if len({summed.numel() for summed in unchecked}) == 1:  # no capacity change: one stack, one narrow
            stacked = torch.stack(unchecked).narrow(1, 0, _HEADER).cpu()  # one sync
        else:
            stacked = torch.stack([summed.narrow(0, 0, _HEADER) for summed in unchecked]).cpu()
        wheres, history = self._wheres, self._history
        self._unchecked, self._wheres = [], []
        self._history = [(0, history[-1][1])] if history else []
        if not _all_well_formed(stacked, self.world_size):  # then find the first bad step, row by row
            for step, (row, where) in enumerate(zip(stacked.tolist(), wheres, strict=True)):
                if not _same_everywhere(self._parse(row)):
                    entries = next(entries for first, entries in reversed(history) if first <= step)
                    self._raise_mismatch(where, entries)
        self.extremes = _power_of_two(_counts(self._parse(stacked[-1].tolist()))[1])

    def unpack(
        self, summed: Tensor, where: str = "this step", extremes: Tensor | None = None
    ) -> dict[str, Reduced] | None:
        """One checked step: read the summed header (a host read), raise :class:`MetricMismatchError` when the
        ranks differ; None when the agreed sizes had to change (pack and reduce again); else the reductions
        (``extremes``: the maxed :meth:`pack_extremes`)."""
        header = self._parse(summed[:_HEADER].tolist())
        if not _same_everywhere(header):
            self._raise_mismatch(where, self._window.entries())
        slots, needed = _counts(header)
        if slots > self.capacity or needed > self.extremes or (needed and extremes is None):
            self.capacity = max(self.capacity, _power_of_two(slots))
            self.extremes = max(self.extremes, _power_of_two(needed))
            return None
        reduced = self._values(self._plan(self._window), summed, extremes)
        self.discard()
        return reduced

    def _parse(self, row: list[float]) -> list[int]:
        # Sums of 0/1 over at most world_size ranks: exact in float64; through DDP's float32 average (each rank's
        # flag packed times the world size, divided by it, summed) within far less than 1/2 of one.
        header = [round(x) for x in row]
        if any(abs(x - n) > 0.25 for x, n in zip(row, header, strict=True)):
            raise RuntimeError(f"shardplus: the training-metrics header summed to non-integers: {row}.")
        if not 0 < header[0] <= self.world_size:  # ranks without data in a step do not contribute
            raise RuntimeError(
                f"shardplus: the training-metrics collective summed {header[0]} contributions, expected 1 to "
                f"{self.world_size}."
            )
        return header

    def _raise_mismatch(self, where: str, entries: list[tuple[str, str, str]]) -> None:
        gathered = self._all_gather_object(entries)  # every rank gets here: the header sums are shared
        self.discard()
        self._unchecked, self._wheres, self._history, self._layout = [], [], [], None
        raise MetricMismatchError(describe_mismatch(gathered, where))


def _same_everywhere(header: list[int]) -> bool:
    """Whether every contributing rank sent the same header: each bit summed over the contributors is 0 (all
    sent 0) or the number of contributors (all sent 1)."""
    contributors = header[0]
    return all(bit in (0, contributors) for bit in header[1:])


def _all_well_formed(headers: Tensor, world_size: int) -> bool:
    """:func:`_same_everywhere` (and the checks of ``_parse``) for every row of ``headers`` (a host tensor) at once,
    in numpy (a few microseconds where torch's small operations take tens)."""
    values = headers.numpy()
    rounded = values.round()
    contributors = rounded[:, :1]
    bits = rounded[:, 1:]
    return bool(
        (abs(values - rounded) <= 0.25).all()
        and ((contributors > 0) & (contributors <= world_size)).all()
        and ((bits == 0) | (bits == contributors)).all()
    )


def _counts(header: list[int]) -> tuple[int, int]:
    """The SUM and MAX slot counts of a header every contributor sent alike (:func:`_same_everywhere`)."""
    contributors = header[0]

    def number(first: int) -> int:
        return sum(1 << i for i in range(_COUNT_BITS) if header[first + i] == contributors)

    return number(1), number(1 + _COUNT_BITS)


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
        weighted_sum = reduced.weighted_sum.to(dtype=value.dtype, device=value.device)
        return value + weighted_sum, count + reduced.weight.round().to(dtype=count.dtype, device=count.device)
    step = reduced.value_as(value.dtype, value.device)
    if reduce_fx == "sum":
        return value + step, count
    if reduce_fx == "max":
        return torch.maximum(value, step), count
    return torch.minimum(value, step), count


# -------------------------------------------------------------------- Lightning glue


def _all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, async_op=async_op)  # looked up at call time: tests count it


def _all_gather_object(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


@dataclass
class _Pending:
    """A metric observed in the current step, and where its step/epoch values go once reduced."""

    logged: _lightning.LoggedValue
    epoch_state_before: tuple[Tensor, Tensor | None] | None  # at its first observation in the step


class CarriedCount:
    """A number summed over ranks in a training step's metrics collective: see
    :meth:`AverageTrainingMetrics.carry`."""

    __slots__ = ("count", "_total")

    def __init__(self, count: int) -> None:
        self.count = count
        self._total: Tensor | None = None  # a host tensor: set when the step's collective has completed

    def deliver(self, total: Tensor | None) -> None:
        """The step's collective completed: ``total`` is the sum over ranks (a host tensor)."""
        self._total = total

    def total(self) -> int | None:
        """The sum over ranks, or None if no training step's collective has carried it (yet)."""
        # host memory: no device to wait for; round: the sum may have come through DDP's float32 average
        return None if self._total is None else round(self._total.item())


@dataclass
class _BatchWeight:
    batch: Any = None
    weight: float = 1.0
    known: bool = False


# Hooks that run between the start of the last micro-batch's backward and `on_train_batch_end` (automatic
# optimization), in which a value could be logged after the collective started early.
_MODULE_HOOKS_AFTER_BACKWARD_STARTS = (
    "on_before_backward",
    "backward",
    "on_after_backward",
    "optimizer_step",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "lr_scheduler_step",
)
_CALLBACK_HOOKS_AFTER_BACKWARD_STARTS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def logs_only_before_backward(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether no value can be logged between the start of a step's last backward and ``on_train_batch_end``:
    automatic optimization, and neither the LightningModule nor a callback (other than shardplus's own, which
    log nothing averaged) overrides a hook that runs there. The same code on every rank gives the same answer.
    Then the training-metrics collective can start when backward starts, and run during it."""
    if not pl_module.automatic_optimization:
        return False
    if any(is_overridden(hook, pl_module, pl.LightningModule) for hook in _MODULE_HOOKS_AFTER_BACKWARD_STARTS):
        return False
    return not any(
        is_overridden(hook, callback, Callback)
        for callback in trainer.callbacks
        if not type(callback).__module__.startswith("lightning_shardplus.")
        for hook in _CALLBACK_HOOKS_AFTER_BACKWARD_STARTS
    )


def takes_dataloader_iter(pl_module: pl.LightningModule) -> bool:
    """Whether ``training_step`` fetches its own batches (``dataloader_iter``): then the loop does not fetch one
    batch per step."""
    return is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True)


class AverageTrainingMetrics(Callback):
    """Replaces the training values logged on each rank by their cross-rank reduction, once per logged step (in
    DDP's gradient all-reduce where :meth:`use_carrier` gave a carrier, else one collective; one more with max/min
    values), completed at the start of ``on_train_batch_end`` (so every value logged
    before it, in ``training_step`` as in the backward and optimizer hooks, is in it). Added by
    ``ShardPlusStrategy(average_training_metrics=True)`` as the first callback, so that it runs before any other
    callback (progress bar, checkpointing) reads the metrics.

    Where no hook after backward can log (:func:`logs_only_before_backward`, decided once per fit), the SUM
    buffer is packed in the last micro-batch's ``on_before_backward`` and reduced during backward. A value logged
    after that point anyway (from a hook this check does not know) is this rank's own, with a warning, like values
    logged in ``on_train_batch_end``.

    The reduced values are written back into Lightning's results as device tensors; the names are checked on the
    host at Lightning's logging steps (when the loggers read the values anyway) and at the end of each epoch."""

    def __init__(self) -> None:
        self._reducer: FusedMetricReducer | None = None
        self._restore: Callable[[], None] | None = None
        self._results: Any = None
        self._pending: dict[str, _Pending] = {}  # observed in this step
        self._followed: dict[str, _Pending] = {}  # observed in this rank's last step with values (see `_apply`)
        self._last: dict[str, Tensor] = {}  # the last reduced step value of each metric
        self._warned: set[str] = set()
        self._weight = _BatchWeight()
        self._without_data = False  # this rank had no data in a micro-batch of this logged step (uneven inputs)
        self._start_early = False  # start the collective when the last backward starts (`logs_only_before_backward`)
        self._carry_wanted = False  # a training stream's agreement asked to ride on the collective
        self._trainer: pl.Trainer | None = None  # while training, for `carry`
        self._to_carry: CarriedCount | None = None  # asked for, to go with the next collective
        self._carrying: CarriedCount | None = None  # in the collective started and not finished
        self._carrier: Carrier | None = None  # this fit's gradient carrier, if the strategy gave one
        self._epoch = 0  # the current training epoch (Lightning's `current_epoch`, read once per epoch)

    def use_carrier(self, carrier: Carrier | None) -> None:
        """Let the step's buffer ride in DDP's gradient all-reduce through ``carrier`` (given by the strategy for
        one fit, where DDP averages the gradients as they are and no value can be logged after backward starts:
        :func:`logs_only_before_backward`); None: an all_reduce of its own."""
        self._carrier = carrier

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
        device = trainer.strategy.root_device
        # on a GPU the carried sum would have to be read from the device (a synchronization per step): not carried
        carries = self._carry_wanted and device.type == "cpu" and not takes_dataloader_iter(pl_module)
        self._reducer = FusedMetricReducer(
            trainer.world_size,
            trainer.global_rank,
            _all_reduce,
            _all_gather_object,
            device=device,
            carries=carries,
            carrier=self._carrier,
        )
        self._trainer = trainer
        self._results = _lightning.training_results(trainer)
        self._restore = _lightning.intercept_training_logs(self._results, self._take, self._observe)
        self._start_early = logs_only_before_backward(trainer, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._reducer is not None and self._start_early and _lightning.logs_this_step(trainer):
            self._start()

    def _start(self) -> None:
        assert self._reducer is not None
        self._carrying, self._to_carry = self._to_carry, None
        carried = 0.0 if self._carrying is None else float(self._carrying.count)
        self._reducer.start(self._abstains(), carried)

    def will_carry(self) -> None:
        """A training stream is to be agreed on (``uneven_inputs``, before the fit's training starts): its counts
        may then ride on this collective (:meth:`carry`)."""
        self._carry_wanted = True

    def carry(self, count: int) -> CarriedCount | None:
        """Sum ``count`` over ranks with the next training step's collective instead of in a collective of its own;
        the handle's ``total()`` is the sum once that step's ``on_train_batch_end`` has run. None where it cannot
        ride: no averaging in this fit, values on a GPU, or not every micro-batch is a logged step (gradient
        accumulation); the same answer on every rank. One count at a time: a newer one replaces one not sent."""
        trainer, reducer = self._trainer, self._reducer
        if trainer is None or reducer is None or not reducer.carries or trainer.accumulate_grad_batches != 1:
            return None
        self._to_carry = CarriedCount(count)
        return self._to_carry

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A batch skipped by `on_train_batch_start` returning -1 ends the epoch before `on_train_batch_end`:
        # what it logged is not carried into the next epoch's first step.
        self._epoch = trainer.current_epoch
        if self._reducer is not None:
            self._reducer.discard()
            self._clear_step()
            self._to_carry = self._carrying = None

    def _take(self, log: _lightning.TrainingLog) -> bool:
        if not log.on_step or not log.is_tensor or log.rank_zero_only:
            return False
        if log.sync_dist and log.sync_dist_group is not None:
            return False  # a sync over a sub-group: Lightning's
        if log.fx == "on_train_batch_end":
            when = "were averaged across ranks (at the start of that hook, before callbacks read them)"
        elif self._reducer is not None and self._reducer.started:
            when = "started being averaged across ranks (when its last backward started: no later hook is overridden)"
        else:
            return True
        if log.key not in self._warned:
            self._warned.add(log.key)
            rank_zero_warn(
                f"shardplus: `{log.name}` is logged in `{log.fx}`, after the training metrics of the step {when}: "
                "it is this rank's own value. Log it from `training_step` to average it."
            )
        return False

    def _observe(self, logged: _lightning.LoggedValue) -> None:
        assert self._reducer is not None
        log = logged.log
        reduction = logged.reduce_fx if log.sync_dist and logged.reduce_fx != "mean" else "mean"
        weight = float(log.batch_size) if log.batch_size is not None else self._batch_weight()
        self._reducer.observe(log.key, reduction, logged.value, weight, label=f"`{log.name}` (from {log.fx})")
        previous = self._pending.get(log.key)
        before = previous.epoch_state_before if previous is not None else logged.epoch_state_before
        self._pending[log.key] = _Pending(logged, before)

    def _batch_weight(self) -> float:
        batch = _lightning.current_batch(self._results)
        if not self._weight.known or self._weight.batch is not batch:
            size = _lightning.batch_size_of_current_batch(self._results)
            self._weight = _BatchWeight(batch, float(size) if size is not None else 1.0, True)
        return self._weight.weight

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
        try:
            where = f"epoch {self._epoch}, batch {batch_idx}"
            check = _lightning.loggers_read_this_step(trainer, logs=True)
            if not self._reducer.started:  # not started early (or no backward ran in this step)
                self._start()
            self._apply(self._reducer.finish(where, check))
            if self._carrying is not None:
                self._carrying.deliver(self._reducer.carried_total)
                self._carrying = None
        finally:
            self._clear_step()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._reducer is not None:
            self._reducer.check()  # the steps since the last logging step, before the epoch values are logged

    def _apply(self, reduced: dict[str, Reduced]) -> None:
        """Write the reduced values as the step values (device tensors), and into the epoch state.

        A rank without data in the step (``uneven_inputs="join"``) logged nothing: it writes the values of the
        metrics it logged in its last step with data, which the reducer returns when the other ranks logged the
        same names, so that its step and epoch values (what its schedulers and callbacks read) stay the other
        ranks'."""
        if self._pending:
            self._followed = dict(self._pending)
            entries = self._pending
        else:
            entries = {key: self._followed[key] for key in reduced}
        for key, entry in entries.items():
            logged = entry.logged
            local = logged.value
            # a new tensor: one a callback read earlier in the step (`callback_metrics`) keeps this rank's value
            step = reduced[key].value_as(local.dtype, local.device)
            if local.dim():
                step = step.reshape(local.shape)
            _lightning.set_step_value(logged.metric, step)
            self._last[key] = step
            if entry.epoch_state_before is not None:
                # a metric logged in this step: its state before; a followed one: its state now
                before = entry.epoch_state_before if self._pending else _lightning.epoch_state(logged.metric)
                state = combined_epoch_state(logged.reduce_fx, before, reduced[key])
                _lightning.set_epoch_state(logged.metric, *state)

    def _clear_step(self) -> None:
        self._pending.clear()
        self._without_data = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()
        self._carry_wanted = False  # asked again by the next fit's streams, if it has any
        self._carrier = None  # given again by the next fit's strategy setup

    def _stop(self) -> None:
        if self._restore is not None:
            self._restore()
        self._restore = self._reducer = self._results = self._trainer = None
        self._to_carry = self._carrying = None
        self._clear_step()
        self._last.clear()
        self._followed.clear()
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
        "list_states": {} if result_metric.is_tensor else list_state_layouts(result_metric.value),
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
    ``Metric`` modules do not sync, neither per step nor in Lightning's epoch-end read (which runs on the ranks
    that logged them only); at the epoch end every rank joins one reduction of all logged values, then each
    Metric's own sync in key order: so every rank makes the same collectives whatever its shard. Lightning reads
    the epoch values before that and advises ``sync_dist=True`` for values logged without it: the advice is
    silenced for the values reduced here, during the evaluation run only.
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
                _lightning.set_metric_sync(metric, sync_on_compute=False, dist_sync_on_step=False)

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
        for rank_entries in gathered:  # list-state layouts from any rank that has them
            for key, entry in rank_entries.items():
                entries[key]["list_states"].update(entry["list_states"])
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
