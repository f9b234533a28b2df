"""Runs under Lightning's launcher (``python tests/_model_parallel_streams.py DP TP LIBRARY DATA OUT``): a fit and a
validation of ``ShardPlusModelParallelStrategy`` on a DP x TP mesh reading ``DATA``, a litdata or Mosaic dataset of
the ids 0..n-1 (``LIBRARY``: litdata, mosaic, or mosaic-unreplicated); every rank writes what it trained on and
what validation returned, or the error, to ``OUT.<rank>.json``."""

from __future__ import annotations

import json
import sys

import torch
from _model_parallel_probe import Model, sample
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusModelParallelStrategy


def collate(items: list[dict]):
    """The probe's samples of the stored ids."""
    ids, xs, ys = zip(*(sample(int(item["id"])) for item in items), strict=True)
    return torch.tensor(ids), torch.stack(xs), torch.tensor(ys)


def loader(library: str, data: str, tp: int) -> DataLoader:
    if library == "litdata":
        from litdata import StreamingDataset

        return DataLoader(StreamingDataset(data), batch_size=2, collate_fn=collate)
    from streaming import StreamingDataset

    replication = tp if library == "mosaic" else None
    dataset = StreamingDataset(local=data, batch_size=2, replication=replication, shuffle=False)
    return DataLoader(dataset, batch_size=2, collate_fn=collate)


class StreamModel(Model):
    """The probe's model, its loaders built in each process once the strategy set the distributed environment up."""

    def __init__(self, library: str, data: str) -> None:
        super().__init__()
        self.library, self.data = library, data

    def train_dataloader(self) -> DataLoader:
        return loader(self.library, self.data, self.device_mesh["tensor_parallel"].size())

    val_dataloader = train_dataloader


def main(dp: int, tp: int, library: str, data: str, out: str) -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        accelerator="cpu", devices=dp * tp, strategy=ShardPlusModelParallelStrategy(dp, tp), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model, found = StreamModel(library, data), {}
    try:
        trainer.fit(model)
        found["seen"] = model.seen
        found["validate"] = trainer.validate(StreamModel(library, data), verbose=False)
    except ValueError as error:
        found["error"] = str(error)
    with open(f"{out}.{trainer.global_rank}.json", "w") as file:
        json.dump(found, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
