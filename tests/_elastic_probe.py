"""The training job of the elastic test, run by ``torchrun --nproc-per-node=2 --max-restarts=1`` (``tests/`` on
PYTHONPATH) and, as the uninterrupted reference, in the test process with ``start_method="fork"``.

    python tests/_elastic_probe.py WORKDIR FAIL_AT_STEP

On torchrun's first attempt, rank 1 dies abruptly (``os._exit``) when optimizer step FAIL_AT_STEP starts; torchrun
restarts both workers, which resume from ``last.ckpt`` (``ckpt_path="last"``: none yet means a fresh start).
Every rank records its training batches (with the attempt and the optimizer step) in ``WORKDIR/record``; rank 0
writes the final weights to ``WORKDIR/final.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from _models import IndexedDataset, RecordingModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusStrategy

NUM_SAMPLES, BATCH_SIZE, EPOCHS, CHECKPOINT_EVERY = 22, 2, 2, 2  # 6 optimizer steps per epoch on 2 ranks


class AttemptRecordingModule(RecordingModule):
    """RecordingModule whose rows also say which torchrun attempt and which optimizer step trained the batch."""

    def record(self, stage, indices, **extra):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        super().record(stage, indices, attempt=attempt, step=self.trainer.global_step, **extra)


class DieOnFirstAttempt(pl.Callback):
    """Rank 1 exits abruptly when optimizer step ``step`` starts, on torchrun's first attempt only."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_attempt and trainer.global_rank == 1 and trainer.global_step == self.step:
            os._exit(1)


def fit(workdir: Path, fail_at_step: int | None = None, start_method: str = "popen") -> dict[str, torch.Tensor]:
    """The training run; returns the final weights (in the fork launcher's parent: rank 0's)."""
    torch.manual_seed(0)
    model = AttemptRecordingModule(workdir / "record")
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=workdir / "checkpoints", every_n_train_steps=CHECKPOINT_EVERY, save_last=True)
    ]
    if fail_at_step is not None:
        callbacks.append(DieOnFirstAttempt(fail_at_step))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardPlusStrategy(start_method=start_method, shuffle_seed=3),
        max_epochs=EPOCHS,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader = DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=BATCH_SIZE, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(weights, workdir / "final.pt")
    return weights


if __name__ == "__main__":
    fit(Path(sys.argv[1]), int(sys.argv[2]))
