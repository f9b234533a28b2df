"""Counting communication without patching ``torch.distributed``: the gradient hook's (:class:`CommunicationCounter`)
and the Python API's collectives (:class:`CollectiveCalls`); how, why: docs/compression.md ("Counting what is sent")."""

from __future__ import annotations

import abc
import inspect
import json
import os
import statistics
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

_COUNTED = ("rounds", "buckets", "collectives", "bytes")


class ObservedProcessGroup(dist.ProcessGroup):
    """``group`` as a process group of its own that calls ``observe(tensors)`` with the tensors this rank contributes to
    each all-reduce and all-gather issued through it, then forwards the collective to ``group``. ``torch.distributed``'s
    registry does not know it: ``get_rank(group)``, ``broadcast`` from a source refuse it."""

    def __init__(self, group: dist.ProcessGroup, observe: Callable[[Sequence[torch.Tensor]], None]) -> None:
        super().__init__(group.rank(), group.size())
        self.group, self.observe = group, observe

    def allreduce(self, tensors, opts):  # what `torch.distributed.all_reduce(tensor, group=self)` calls
        self.observe(tensors)
        return self.group.allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts):  # `torch.distributed.all_gather(..., group=self)`
        self.observe(input_tensors)
        return self.group.allgather(output_tensors, input_tensors, opts)


class CommunicationHookWrapper(Callback, abc.ABC):
    """A callback whose :meth:`wrap` ``ShardPlusStrategy`` applies to its gradient communication hook (torch's
    ``allreduce_hook`` when no hook was chosen, so that there is one to wrap). Abstract: a base to subclass, not a
    callback to add (the CLI lists only concrete callbacks)."""

    @abc.abstractmethod
    def wrap(self, hook: Callable) -> Callable:
        """``hook`` with this callback's instrumentation; it must return the future that ``hook`` returns
        (or one completing with its value)."""


def call_with_observed_group(
    hook: Callable, state: Any, bucket: Any, observed: Callable[[dist.ProcessGroup | None], ObservedProcessGroup]
) -> Any:
    """``hook(state, bucket)`` with the process group in ``state`` (itself, or a ``PowerSGDState``'s, which
    ``powerSGD_hook`` reads once at the start of the call) replaced by ``observed(group)``; any other state as is."""
    if state is None or isinstance(state, dist.ProcessGroup):
        return hook(observed(state), bucket)
    if isinstance(state, PowerSGDState):
        own = state.process_group
        state.process_group = observed(own)
        try:
            return hook(state, bucket)
        finally:
            state.process_group = own
    return hook(state, bucket)


class CommunicationCounter(CommunicationHookWrapper):
    """Counts what the gradient communication hook sends on each rank: ``rounds`` (backward passes through the hook),
    ``buckets`` (hook calls), ``collectives`` and their payload ``bytes``. ``records`` holds one row per training
    micro-batch, :meth:`steps` groups them into optimizer steps, :meth:`summary` gives the per-step medians; with
    ``output_dir`` each rank writes ``rank{r}.json`` when training ends (fork workers cannot hand objects back)."""

    def __init__(self, output_dir: str | os.PathLike | None = None) -> None:
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(_COUNTED, 0)
        self._at_batch_start: dict[str, int] = {}
        self._step_at_batch_start = 0
        self._observed: dict[int, ObservedProcessGroup] = {}

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the Trainer's callbacks
        return self.__dict__ | {"_lock": None, "_observed": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def wrap(self, hook: Callable) -> Callable:
        """``hook`` counted: its calls, and the collectives it issues through the process group it is given."""

        def counting_hook(state, bucket):  # no annotations: DDP checks them against its types
            self._count_call(last=bucket.is_last())
            return call_with_observed_group(hook, state, bucket, self._observed_group)

        counting_hook.__qualname__ = f"counted({getattr(hook, '__qualname__', repr(hook))})"
        return counting_hook

    def _count_call(self, last: bool) -> None:
        """One hook call: one bucket, and one round at DDP's last bucket."""
        with self._lock:
            self._totals["buckets"] += 1
            self._totals["rounds"] += int(last)

    def _observed_group(self, group: dist.ProcessGroup | None) -> ObservedProcessGroup:
        """``group`` (None: the default group) seen through this counter; one view per group, made once."""
        real = group if group is not None else dist.group.WORLD
        if id(real) not in self._observed:
            self._observed[id(real)] = ObservedProcessGroup(real, self._count_collective)
        return self._observed[id(real)]

    def _count_collective(self, tensors: Sequence[torch.Tensor]) -> None:
        """One collective the hook issued, from whichever thread it ran in."""
        with self._lock:
            self._totals["collectives"] += 1
            # the bytes this rank hands over (a ring all-reduce moves about 2 (n-1)/n times that)
            self._totals["bytes"] += sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        with self._lock:
            self._at_batch_start = dict(self._totals)
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        with self._lock:
            delta = {key: value - self._at_batch_start.get(key, 0) for key, value in self._totals.items()}
        stepped = trainer.global_step > self._step_at_batch_start
        self.records.append({"epoch": trainer.current_epoch, "batch_idx": batch_idx, "stepped": stepped, **delta})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            report = {"records": self.records, "steps": self.steps(), "summary": self.summary()}
            (self.output_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._observed.clear()  # the views hold the run's process groups

    def steps(self) -> list[dict[str, int]]:
        """The records grouped into optimizer steps: per step, its micro-batches and their summed counts."""
        steps: list[dict[str, int]] = []
        current = {"micro_batches": 0, **dict.fromkeys(_COUNTED, 0)}
        for record in self.records:
            current["micro_batches"] += 1
            for key in _COUNTED:
                current[key] += record[key]
            if record["stepped"]:
                steps.append(current)
                current = dict.fromkeys(current, 0)
        return steps

    def summary(self) -> dict[str, Any]:
        """Per optimizer step (medians): rounds, hook calls, collectives, bytes; and the rounds on micro-batches that
        did not step the optimizer."""
        steps = self.steps()
        medians = {key: float(statistics.median(step[key] for step in steps)) if steps else 0.0 for key in _COUNTED}
        return {
            "optimizer_steps": len(steps),
            "micro_batches": len(self.records),
            **{f"{key}_per_step": median for key, median in medians.items()},
            "rounds_on_non_stepping_micro_batches": sum(r["rounds"] for r in self.records if not r["stepped"]),
        }


# torch's names of the operations its pre-collective hooks report, as torch.distributed's functions call them
_KINDS = {
    "ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "REDUCE_SCATTER": "reduce_scatter", "ALLTOALL": "all_to_all"
}  # fmt: skip
_PYTHON_API = "torch.distributed.distributed_c10d"  # the module of torch.distributed's collective functions
_CALLER_DEPTH = 4  # frames searched for it under the hook: the function, or it behind an ObservedProcessGroup


class CollectiveCalls:
    """How many collectives of each kind (``"all_reduce"``, ``"barrier"``, ...) were issued on a process group through
    ``torch.distributed``'s Python functions between :meth:`start` and :meth:`stop`, from any thread (not DDP's C++
    reducer's). Start and stop between steps: torch expects no collective running while hooks change."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._group: dist.ProcessGroup | None = None
        self._lock: threading.Lock | None = None  # made by `start`: a Lock cannot be pickled (spawn pickles callbacks)

    @staticmethod
    def available() -> bool:
        """Whether this torch has pre-collective hooks on its process groups."""
        return hasattr(dist.ProcessGroup, "register_pre_hook")

    def start(self, group: dist.ProcessGroup | None = None) -> bool:
        """Count on ``group`` (None: the default group) from now on; False where torch cannot."""
        if self._group is not None:
            return True
        if not (self.available() and dist.is_available() and dist.is_initialized()):
            return False
        self._lock = threading.Lock()
        self._group = group if group is not None else dist.group.WORLD
        self._group.register_pre_hook(id(self), self._count)
        return True

    def stop(self) -> None:
        """Stop counting (the counts are kept)."""
        if self._group is not None:
            self._group.unregister_pre_hook(id(self))
            self._group = None

    def snapshot(self) -> dict[str, int]:
        """The counts so far, by kind."""
        if self._lock is None:
            return dict(self.counts)
        with self._lock:
            return dict(self.counts)

    def _count(self, args: Any) -> None:
        """torch's pre-collective hook: count the collective if torch.distributed's Python API issued it."""
        if not _issued_through_python_api(inspect.currentframe().f_back):  # None on a thread without Python frames
            return
        name = args.name.name
        kind = _KINDS.get(name, name.lower())
        assert self._lock is not None
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1


def _issued_through_python_api(frame: FrameType | None) -> bool:
    """Whether one of the frames under a pre-collective hook is a ``torch.distributed`` collective function."""
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _PYTHON_API:
            return True
        frame = frame.f_back
    return False
