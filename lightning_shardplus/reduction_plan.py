"""The packed collective of one optimizer step's training values (:mod:`training_metrics`): which slots each name takes
in one float64 vector, this rank's vector, its reduction over the ranks (async) and each name's value from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

_F64, _INF = torch.float64, float("inf")
_SLOTS = {"mean": 4, "sum": 2, "max": 1, "min": 1}  # summed: (w * v, w, v, calls), (v, calls), (calls)


class Call(NamedTuple):
    """This rank's last ``self.log`` of a name in a micro-batch."""

    value: Tensor  # as Lightning stored it for the step
    weight: float
    reduction: str  # over ranks: the ``reduce_fx`` of a ``sync_dist`` value, else "mean"
    late: bool  # logged after the step's first reduction started


class ReductionPlan:
    """Where each name of one reduction lives in the packed float64 vector: slot 0 counts the ranks that logged a
    name outside the layout, then each name's summed slots (:data:`_SLOTS`), then per max/min its (signed value,
    NaN flag), reduced by MAX."""

    def __init__(self, entries: dict[str, str], device: torch.device) -> None:
        self.entries, self.offset, size = entries, {}, 1  # key -> reduction
        for key, reduction in entries.items():
            self.offset[key], size = size, size + _SLOTS[reduction]
        self.summed, order = size, [[k for k, r in entries.items() if r == kind] for kind in ("mean", "sum")]
        self.extremes = [key for key, reduction in entries.items() if reduction in ("max", "min")]
        self.extreme = {key: size + 2 * i for i, key in enumerate(self.extremes)}
        self.position = {key: i for i, key in enumerate(order[0] + order[1] + self.extremes)}
        self.means, self.sums = (_on([self.offset[k] for k in keys], torch.long, device) for keys in order)
        self.extreme_calls = _on([self.offset[key] for key in self.extremes], torch.long, device)
        self.maxima = _on(list(self.extreme.values()), torch.long, device)
        self.signs = _on([1.0 if entries[key] == "max" else -1.0 for key in self.extremes], _F64, device)

    def pack(self, calls: list[tuple[str, Call]], unplaced: bool, device: torch.device) -> Tensor:
        """This rank's vector for ``calls`` (each in this plan, with this plan's reduction)."""
        constants = [float(unplaced)] + [0.0] * (self.summed - 1) + [-_INF, 0.0] * len(self.extremes)
        added, maxed = [], []  # (call, slot, factor)
        for i, (key, call) in enumerate(calls):
            slot, reduction = self.offset[key], self.entries[key]
            constants[slot + _SLOTS[reduction] - 1] += 1  # its calls
            if reduction == "mean":
                constants[slot + 1] += call.weight
                added += [(i, slot, call.weight), (i, slot + 2, 1.0)]
            elif reduction == "sum":
                added.append((i, slot, 1.0))
            else:
                maxed.append((i, self.extreme[key], 1.0 if reduction == "max" else -1.0))
        vector = _on(constants, _F64, device)
        if calls:
            stacked = torch.stack([call.value.detach().reshape(()).to(device, _F64) for _, call in calls])
        if added:
            rows, slots, factors = zip(*added, strict=True)
            vector.index_add_(0, _on(slots, torch.long, device), stacked[list(rows)] * _on(factors, _F64, device))
        if maxed:
            rows, slots, signs = zip(*maxed, strict=True)
            signed, where = stacked[list(rows)] * _on(signs, _F64, device), _on(slots, torch.long, device)
            vector.scatter_reduce_(0, where, signed.nan_to_num(nan=-_INF, posinf=_INF, neginf=-_INF), "amax")
            vector.scatter_reduce_(0, where + 1, signed.isnan().to(_F64), "amax")
        return vector

    def start(self, vector: Tensor) -> tuple[list[Any], Tensor]:
        """Start this rank's part of the reduction (async): a SUM all_reduce, and with max/min names a MAX one of
        their part (both in flight together; an all_gather would grow with the world size)."""
        summed, maxed = vector.split([self.summed, vector.numel() - self.summed])
        works = [dist.all_reduce(summed, op=dist.ReduceOp.SUM, async_op=True)]
        if self.extremes:
            works.append(dist.all_reduce(maxed, op=dist.ReduceOp.MAX, async_op=True))
        return works, vector

    def finish(self, works: list[Any], v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Wait (on NCCL: the device's stream, not the host); the summed header, each name's value over the ranks
        that logged it (in :attr:`position` order) and how many calls it had."""
        for work in works:
            work.wait()
        weighted, weight, plain, calls = (v[self.means + i] for i in range(4))
        extremes = torch.where(v[self.maxima + 1] > 0, float("nan"), v[self.maxima] * self.signs)
        values = torch.cat([torch.where(weight > 0, weighted / weight, plain / calls), v[self.sums], extremes])
        return v[0], values, torch.cat([calls, v[self.sums + 1], v[self.extreme_calls]])


def _on(numbers: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host numbers on the device, the copy queued without waiting for the device."""
    return torch.tensor(numbers, dtype=dtype).to(device, non_blocking=True)
