"""ScalingReport's own work per micro-batch, timed in this process without training (the ``shardplus-report`` row's
overhead, the other way)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from lightning_shardplus.diagnostics import ScalingReport


def measure_report_cost(micro_batches: int = 5000, profiled_actions: int = 40) -> float:
    """An upper bound of ScalingReport's own work per micro-batch, in microseconds, timed in this process without
    training (the fastest of 7 rounds): its hooks, the hook it puts on the loss and the mark at the end of the
    backward computation (called directly here: there is no backward pass to queue it in), and its profiler wrapper
    around Lightning's no-op profiler (the batch fetch and ``profiled_actions`` other actions Lightning profiles per
    step, including what the no-op profiler itself costs). The paired rows measure everything."""
    from lightning.pytorch.profilers import PassThroughProfiler

    from lightning_shardplus._compat.lightning import TRAIN_DATALOADER_NEXT
    from lightning_shardplus.diagnostics.scaling_report import _FetchTimingProfiler

    report = ScalingReport(skip_first_steps=0, verbose=False)
    report._world_size, report._batch_size = 2, 1
    wrapped = _FetchTimingProfiler(PassThroughProfiler(), report)

    def profile_actions(profiler: Any) -> None:
        for _ in range(profiled_actions):
            with profiler.profile("[Callback]Other.on_train_batch_start"):
                pass

    trainer: Any = SimpleNamespace(strategy=SimpleNamespace(fusion_tuning=False))  # what the hooks read of it

    def one_step() -> None:
        report.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        loss = torch.zeros((), requires_grad=True)  # a new loss each step, as in training: its hook dies with it
        report.on_before_backward(trainer, None, loss)  # type: ignore[arg-type]
        report._mark_computed()
        report.on_after_backward(trainer, None)  # type: ignore[arg-type]
        report.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
        wrapped.start(TRAIN_DATALOADER_NEXT)
        wrapped.stop(TRAIN_DATALOADER_NEXT)
        profile_actions(wrapped)

    def seconds(step: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(micro_batches):
            step()
        return time.perf_counter() - start

    report._previous_end = time.perf_counter()
    return 1e6 * min(seconds(one_step) for _ in range(7)) / micro_batches
