"""``FSDP2Gradients``: FSDP2 and tensor parallel's gradient side. A forward is a collective (FSDP2 gathers the
parameters in it), so every data-parallel rank runs every one: a rank without data on a stand-in batch; FSDP2
reduces the gradients itself (no hook, no bucket), and a window's gradients are kept as their data-parallel sum."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.gradients.fsdp2 import window


class FSDP2Gradients:
    """The gradient side of ``ShardPlusModelParallelStrategy``."""

    forward_communicates = True
    ranks = "data-parallel ranks (model parallel)"

    def features(self) -> list[str]:
        return []

    def window_gradients(
        self, module: torch.nn.Module, data_parallel: DataParallel, done: int, frequency: int
    ) -> dict[str, Any] | None:
        if not window.FSDP2_WINDOW_GRADIENTS_READABLE:
            return None
        return window.data_parallel_sum_entry(module, data_parallel, done, frequency)

    set_window_gradients = staticmethod(window.set_gradients)

    def checkpointed(self, states: dict[str, Any], checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        pass  # no state of its own

    def start_fit(self, trainer: pl.Trainer, backend: str, device: torch.device) -> None:
        return None
