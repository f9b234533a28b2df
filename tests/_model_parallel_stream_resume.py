"""``python tests/_model_parallel_stream_resume.py DP TP DATA DIR SHUFFLE WORKERS``: a litdata stream
(``StreamingDataLoader``, shuffled if SHUFFLE is 1, with WORKERS loader processes) under
``ShardPlusModelParallelStrategy`` on a DP x TP mesh: an uninterrupted 1-epoch fit saves a distributed checkpoint at
optimizer step 2, and a new fit resumes from it (where DIR holds that checkpoint already, from another mesh: only the
resume); every rank writes what each fit read to ``DIR/found.<DP>.<rank>.json``."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from _model_parallel_streams import StreamModel, collate
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shardplus import ShardPlusModelParallelStrategy


class ResumableStreamModel(StreamModel):
    """Its training stream through litdata's own loader, which has a ``state_dict``."""

    def __init__(self, data: str, shuffle: bool, workers: int) -> None:
        super().__init__("litdata", data)
        self.shuffle, self.workers = shuffle, workers

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        dataset = StreamingDataset(self.data, shuffle=self.shuffle, seed=7, drop_last=False)  # every sample
        return StreamingDataLoader(dataset, batch_size=2, collate_fn=collate, num_workers=self.workers)


def fit(dp: int, tp: int, data: str, folder: Path, shuffle: bool, workers: int, ckpt_path: Path | None = None):
    save = ckpt_path is None
    callbacks = [ModelCheckpoint(folder, "{step}", every_n_train_steps=2, save_top_k=-1)] if save else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=dp * tp, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=save,
        strategy=ShardPlusModelParallelStrategy(dp, tp, save_distributed_checkpoint=True),
    )  # fmt: skip
    model = ResumableStreamModel(data, shuffle, workers)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def main(dp: int, tp: int, data: str, folder: Path, shuffle: bool, workers: int) -> None:
    """A fit saved at step 2 (unless saved before, on another mesh), then its resume: what each read, per rank."""
    saved = folder / "step=2.ckpt"
    whole = None if saved.exists() else fit(dp, tp, data, folder, shuffle, workers).seen  # saved before: another mesh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(dp, tp, data, folder, shuffle, workers, ckpt_path=saved)
    said = [str(w.message) for w in caught if "positions of" in str(w.message)]
    # what the resumed fit read, and the samples it trained with data over the data-parallel ranks (a stand-in step,
    # on a rank whose stream ran out, reads its last batch again and trains nothing)
    found = {"whole": whole, "resumed": resumed.seen, "trained": resumed.samples_trained, "said": said}
    (folder / f"found.{dp}.{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6]))
