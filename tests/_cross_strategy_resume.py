"""Checkpoints of Lightning's own ``ModelParallelStrategy`` resumed under ``ShardPlusModelParallelStrategy``.
``python tests/_cross_strategy_resume.py save DIR`` (under Lightning's launcher, 2 processes): plain
``ModelParallelStrategy`` fits one epoch of 3 batches per rank and saves a distributed and a full checkpoint at every
step. ``python tests/_cross_strategy_resume.py resume DIR`` (one process; each fit forks its 2 ranks): shardplus
resumes from step 2 (inside the epoch: refused, no sampler state) and from step 3 (the epoch's end) in both formats,
and writes each refusal's text, or what each rank trained after the resume, to ``DIR/resumed.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from _model_parallel_probe import Samples
from _model_parallel_resume import MomentumModel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusModelParallelStrategy


class Recording(MomentumModel):
    """Writes the samples each rank trained to ``DIR/seen.<rank>.json`` at the end of the fit."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def on_train_end(self) -> None:
        (self.folder / f"seen.{self.global_rank}.json").write_text(json.dumps(self.seen))


def trainer(strategy: pl.strategies.Strategy, max_epochs: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=max_epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def loader() -> DataLoader:
    return DataLoader(Samples(12), batch_size=2, shuffle=True)


def main(mode: str, folder: Path) -> None:
    found = {}
    for distributed in (True, False):
        saved = folder / f"distributed={distributed}"
        if mode == "save":
            every_step = ModelCheckpoint(saved, "{step}", every_n_train_steps=1, save_top_k=-1)
            plain = ModelParallelStrategy(2, 1, save_distributed_checkpoint=distributed)
            trainer(plain, 1, callbacks=[every_step]).fit(MomentumModel(), loader())
            continue
        for step in (2, 3):
            shardplus = ShardPlusModelParallelStrategy(
                2, 1, save_distributed_checkpoint=distributed, start_method="fork"
            )
            key = f"distributed={distributed} step={step}"
            try:
                trainer(shardplus, 2, enable_checkpointing=False).fit(
                    Recording(folder), loader(), ckpt_path=saved / f"step={step}.ckpt"
                )
            except Exception as refusal:  # noqa: BLE001  (the worker's, raised again by the fork launcher)
                found[key] = str(refusal)
            else:
                found[key] = [json.loads((folder / f"seen.{rank}.json").read_text()) for rank in range(2)]
    if mode == "resume":
        (folder / "resumed.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
