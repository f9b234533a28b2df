"""Mid-epoch resume under ``ShardPlusModelParallelStrategy`` (``python tests/_model_parallel_resume.py DP TP DIR``):
with DP x TP as saved (``DIR`` empty) an uninterrupted 2-epoch fit saves at optimizer step 4 (inside epoch 1), in a
distributed and in a full checkpoint, and a new fit resumes from each; with another DP (``DIR`` holding those
checkpoints) only the resumes run. Every rank writes what it read after the resume to ``DIR/found.<DP>.<rank>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _model_parallel_probe import Model, Samples, full_weights
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusModelParallelStrategy


class MomentumModel(Model):
    """With momentum: Lightning's loader of a full model-parallel checkpoint fails on an optimizer without state
    (``_rekey_optimizer_state_if_needed`` reads its first key), under plain ``ModelParallelStrategy`` too."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(dp: int, tp: int, folder: Path) -> None:
    def fit(distributed: bool, ckpt_path: Path | None = None, save: bool = False) -> Model:
        callbacks = [ModelCheckpoint(folder / f"distributed={distributed}", "{step}", every_n_train_steps=4,
                                     save_top_k=-1)] if save else []  # fmt: skip
        trainer = pl.Trainer(
            accelerator="cpu", devices=dp * tp, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, enable_checkpointing=save,
            strategy=ShardPlusModelParallelStrategy(dp, tp, save_distributed_checkpoint=distributed),
        )  # fmt: skip
        model = MomentumModel()
        trainer.fit(model, DataLoader(Samples(10), batch_size=2, shuffle=True), ckpt_path=ckpt_path)
        return model

    found = {}
    for distributed in (True, False):
        saved = folder / f"distributed={distributed}" / "step=4.ckpt"
        if not saved.exists():
            whole = fit(distributed, save=True)
            found[f"uninterrupted distributed={distributed}"] = {"seen": whole.seen, "weights": full_weights(whole)}
        resumed = fit(distributed, ckpt_path=saved)
        found[f"resumed distributed={distributed}"] = {"seen": resumed.seen, "weights": full_weights(resumed)}
    (folder / f"found.{dp}.{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
