"""The packed collective of one optimizer step's training values (:mod:`training_metrics`): which slots each name takes
in one float64 vector, this rank's vector, its reduction over the ranks (async) and each name's value from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

_F64, _INF = torch.float64, float("inf")


class Call(NamedTuple):
    """This rank's last ``self.log`` of a name in a micro-batch."""

    value: Tensor  # as Lightning stored it for the step
    weight: float
    reduction: str  # over ranks: the ``reduce_fx`` of a ``sync_dist`` value, else "mean"
    late: bool  # logged after the step's first reduction started


class ReductionPlan:
    """Where each name of one reduction lives in the packed float64 vector, in blocks (so that unpacking is a few
    operations on views): slot 0 counts the ranks that logged a name outside the layout; for the M means their
    weight x value, weight, value and calls; for the S sums value and calls; for the E max/min names calls; then,
    reduced by MAX, the max/min names' signed values and NaN flags. Names are in :attr:`position` order: means,
    sums, max/min."""

    def __init__(self, entries: dict[str, str], device: torch.device) -> None:
        self.entries = entries  # key -> reduction
        order = [[key for key, reduction in entries.items() if reduction in kinds] for kinds in _KINDS]
        self.means, self.sums, self.extremes = (len(keys) for keys in order)
        self.position = {key: i for i, key in enumerate(order[0] + order[1] + order[2])}
        self.summed = 1 + 4 * self.means + 2 * self.sums + self.extremes
        self._signs = [1.0 if entries[key] == "max" else -1.0 for key in order[2]]
        self.signs = _on(self._signs, _F64, device)

    def pack(self, calls: list[tuple[str, Call]], unplaced: bool, device: torch.device) -> Tensor:
        """This rank's vector for ``calls`` (each in this plan, with this plan's reduction)."""
        m, s, e = self.means, self.sums, self.extremes
        constants = [float(unplaced)] + [0.0] * (self.summed - 1) + [-_INF] * e + [0.0] * e
        added, maxed = [], []  # (call, slot, factor)
        for i, (key, call) in enumerate(calls):
            p = self.position[key]
            if p < m:
                constants[1 + m + p] += call.weight
                constants[1 + 3 * m + p] += 1  # its calls
                added += [(i, 1 + p, call.weight), (i, 1 + 2 * m + p, 1.0)]
            else:
                constants[1 + 3 * m + s + p] += 1  # its calls
                if p < m + s:
                    added.append((i, 1 + 3 * m + p, 1.0))
                else:
                    maxed.append((i, self.summed + p - m - s, self._signs[p - m - s]))
        vector = _on(constants, _F64, device)
        if calls:
            stacked = torch.stack([call.value.detach().reshape(()).to(device) for _, call in calls]).to(_F64)
        if added:
            rows, slots, factors = zip(*added, strict=True)
            vector.index_add_(0, _on(slots, torch.long, device), stacked[list(rows)] * _on(factors, _F64, device))
        if maxed:
            rows, slots, signs = zip(*maxed, strict=True)
            signed, where = stacked[list(rows)] * _on(signs, _F64, device), _on(slots, torch.long, device)
            vector.scatter_reduce_(0, where, signed.nan_to_num(nan=-_INF, posinf=_INF, neginf=-_INF), "amax")
            vector.scatter_reduce_(0, where + e, signed.isnan().to(_F64), "amax")
        return vector

    def start(self, vector: Tensor, group: Any = None) -> tuple[list[Any], Tensor]:
        """Start this rank's part of the reduction over ``group`` (async): a SUM all_reduce, and with max/min names a
        MAX one of their part (both in flight together; an all_gather would grow with the world size)."""
        summed, maxed = vector.split([self.summed, vector.numel() - self.summed])
        works = [dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=True)]
        if self.extremes:
            works.append(dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group, async_op=True))
        return works, vector

    def finish(self, works: list[Any], v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Wait (on NCCL: the device's stream, not the host); the summed slot 0, each name's value over the ranks
        that logged it (in :attr:`position` order) and how many calls it had."""
        for work in works:
            work.wait()
        m, s, e, end = self.means, self.sums, self.extremes, self.summed
        parts, calls = [], v[1 + 3 * m : 1 + 4 * m]
        if m:
            weighted, weight, plain = v[1 : 1 + m], v[1 + m : 1 + 2 * m], v[1 + 2 * m : 1 + 3 * m]
            parts.append(torch.where(weight > 0, weighted / weight, plain / calls))
        if s:
            parts.append(v[1 + 4 * m : 1 + 4 * m + s])
        if e:
            parts.append(torch.where(v[end + e :] > 0, float("nan"), v[end : end + e] * self.signs))
        if s or e:
            calls = torch.cat([calls, v[1 + 4 * m + s : end]])
        return v[0], parts[0] if len(parts) == 1 else torch.cat(parts) if parts else v[:0], calls


_KINDS = (("mean",), ("sum",), ("max", "min"))


def _on(numbers: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host numbers on the device, the copy queued without waiting for the device."""
    return torch.tensor(numbers, dtype=dtype).to(device, non_blocking=True)
