"""Mid-epoch resume under ``ShardPlusModelParallelStrategy`` (``python tests/_model_parallel_resume.py DP TP DIR``):
with DP x TP as saved (``DIR`` empty) an uninterrupted 2-epoch fit saves at optimizer step 4 (inside epoch 1), in a
distributed and in a full checkpoint, and a new fit resumes from each; with another DP (``DIR`` holding those
checkpoints) only the resumes run. As saved, also with ``aggregation_frequency=2``: a checkpoint inside a window
(after epoch 1's first micro-batch) and a resume from it, also with FSDP2 reducing one unit in float64 (whose
window gradients cannot be read: the resume warns); with another DP, a resume from that window checkpoint too. Every
rank writes what it read after the resume to ``DIR/found.<DP>.<rank>.json``."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _model_parallel_probe import Model, Samples, full_weights
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusModelParallelStrategy
from lightning_shardplus._compat.lightning import RESUMES_INSIDE_A_WINDOW
from lightning_shardplus.gradients.fsdp2.window import FSDP2_WINDOW_GRADIENTS_READABLE

# torch 2.6 (FSDP2's public unshard) and Lightning 2.5 (a resume inside a window at its micro-batch)
WINDOWS = FSDP2_WINDOW_GRADIENTS_READABLE and RESUMES_INSIDE_A_WINDOW


class MomentumModel(Model):
    """With momentum: Lightning's loader of a full model-parallel checkpoint fails on an optimizer without state
    (``_rekey_optimizer_state_if_needed`` reads its first key), under plain ``ModelParallelStrategy`` too."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ReduceDtypeModel(MomentumModel):
    """FSDP2 reducing ``l1`` in float64: it accumulates that unit's window gradients in a buffer of its own, not on the
    parameters (``l2``'s stay readable)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.l1, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float64))
        for module in (self.l2, self):
            fully_shard(module, mesh=mesh)


class SaveInsideWindow(Callback):
    """A checkpoint after epoch 1's first micro-batch: inside an aggregation window of 2."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 0:
            trainer.save_checkpoint(self.path)


def main(dp: int, tp: int, folder: Path) -> None:
    def fit(distributed: bool, ckpt_path: Path | None = None, save: bool = False, window: bool = False,
            model_class: type[Model] = MomentumModel) -> Model:  # fmt: skip
        callbacks = [ModelCheckpoint(folder / f"distributed={distributed}", "{step}", every_n_train_steps=4,
                                     save_top_k=-1)] if save and not window else []  # fmt: skip
        if save and window:
            callbacks = [SaveInsideWindow(folder / f"window {model_class.__name__} distributed={distributed}.ckpt")]
        trainer = pl.Trainer(
            accelerator="cpu", devices=dp * tp, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, enable_checkpointing=save and not window,
            strategy=ShardPlusModelParallelStrategy(
                dp, tp, save_distributed_checkpoint=distributed, aggregation_frequency=2 if window else 1
            ),
        )  # fmt: skip
        model = model_class()
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
        window = folder / f"window MomentumModel distributed={distributed}.ckpt"
        if WINDOWS and not window.exists():
            whole = fit(distributed, save=True, window=True)
            found[f"window uninterrupted distributed={distributed}"] = {"weights": full_weights(whole)}
            resumed = fit(distributed, ckpt_path=window, window=True)
            weights = full_weights(resumed)
            found[f"window resumed distributed={distributed}"] = {"seen": resumed.seen, "weights": weights}
        elif WINDOWS and distributed:  # another data-parallel size: the mean, said
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed = fit(distributed, ckpt_path=window, window=True)
            said = any("saved on 2 processes, on 3" in str(w.message) for w in caught)
            found["window resumed elsewhere"] = {"seen": resumed.seen, "warned": said}
    window = folder / "window ReduceDtypeModel distributed=True.ckpt"
    if WINDOWS and not window.exists():
        fit(True, save=True, window=True, model_class=ReduceDtypeModel)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(True, ckpt_path=window, window=True, model_class=ReduceDtypeModel)
        found["reduce_dtype: warned"] = any("without the gradients accumulated" in str(w.message) for w in caught)
    (folder / f"found.{dp}.{dist.get_rank()}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
