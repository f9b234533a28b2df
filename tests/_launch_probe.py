"""A model and a callback for the launcher tests, loaded by ``class_path`` from the ``shardplus`` CLI in processes
started by torchrun or mpirun (``tests/`` on PYTHONPATH). Every rank writes what it saw to ``rank<global rank>.json``
in ``record_dir``; every checkpoint save appends the saving rank to ``saves.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _models import IndexedDataset
from torch import nn
from torch.utils.data import DataLoader


class ProbeModule(pl.LightningModule):
    """A linear classifier on ``IndexedDataset(num_samples)`` that records the training indices of its rank."""

    def __init__(self, record_dir: str, num_samples: int = 13, batch_size: int = 2) -> None:
        super().__init__()
        self.record_dir = Path(record_dir)
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.layer = nn.Linear(4, 3)
        self.indices: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.num_samples), batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        inputs, labels, indices = batch
        self.indices.extend(indices.tolist())
        return F.cross_entropy(self.layer(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        trainer = self.trainer
        row = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "strategy": type(trainer.strategy).__name__,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
            "indices": self.indices,
        }
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


class RecordSaves(pl.Callback):
    """Records which rank's CheckpointIO writes each checkpoint file (the strategy lets global rank 0 only)."""

    def __init__(self, record_dir: str) -> None:
        self.record_dir = Path(record_dir)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        checkpoint_io = trainer.strategy.checkpoint_io
        save = checkpoint_io.save_checkpoint
        record = self.record_dir / "saves.jsonl"
        record.parent.mkdir(parents=True, exist_ok=True)

        def recording_save(checkpoint, path, *args, **kwargs):
            with open(record, "a") as f:
                f.write(json.dumps({"rank": trainer.global_rank, "pid": os.getpid(), "path": str(path)}) + "\n")
            return save(checkpoint, path, *args, **kwargs)

        checkpoint_io.save_checkpoint = recording_save
