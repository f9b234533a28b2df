"""``GradientSide``: what differs between the gradient sides the data side serves (DDP's; FSDP2's with tensor
parallel). Each strategy hands its own to the data side, which asks it and never tests which one it is."""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from lightning_shardplus.data.group import DataParallel


class GradientRun(Protocol):
    """A gradient side's state for one Trainer run, saved in checkpoints beside the data side's."""

    def checkpoint_states(self, checkpoint_path: Any) -> dict[str, Any]:
        """Checkpoint entries by key (every rank calls it; a part may write per-rank files beside the checkpoint)."""

    def load_states(self, states: dict[str, Any]) -> None:
        """Take this side's entries of a loaded checkpoint's ``states`` (popped)."""


class GradientSide(Protocol):
    """Example: ``DDPGradients`` (``gradients/ddp/side.py``), ``FSDP2Gradients`` (``gradients/fsdp2/side.py``)."""

    forward_communicates: bool
    """Whether a forward pass is a collective (FSDP2 gathers the parameters in it): then every data-parallel rank runs
    every forward, a rank without data on a stand-in batch, and evaluation shards run in equal steps."""

    ranks: str
    """How the start-up line names the data-parallel ranks ("processes")."""

    def features(self) -> list[str]:
        """What the start-up line adds to the data side's features in a fit."""

    def window_gradients(
        self, module: torch.nn.Module, data_parallel: DataParallel, done: int, frequency: int
    ) -> dict[str, Any] | None:
        """The checkpoint entry of the gradients accumulated inside an aggregation window after ``done`` of its
        ``frequency`` micro-batches (a collective, on every rank); None where this side cannot read them."""

    def set_window_gradients(self, module: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
        """Give ``module``'s parameters the window's ``gradients`` (whole tensors by name) on resume."""

    def checkpointed(self, states: dict[str, Any], checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """Add this side's entries of a loaded ``checkpoint`` to ``states``."""

    def start_fit(self, trainer: pl.Trainer, backend: str, device: torch.device) -> GradientRun | None:
        """This side's state for a fit (None: it has none), once the aggregation frequency is set."""
