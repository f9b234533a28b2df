"""Train on a litdata stream whose shards differ in length per rank: every rank takes the same steps.

    pip install -e '.[streaming,examples]'   # on a CPU machine, torch and torchvision first: docs/uneven-inputs.md
    python examples/train_stream.py                        # uneven_inputs="join": every sample, every epoch
    python examples/train_stream.py --uneven-inputs drop   # every rank stops where the shortest stream does

The digits are written once as a litdata dataset (``--data-dir``). litdata keeps its tail (``drop_last=False``), so
on 3 processes one rank streams 31 batches per epoch and the others 30. Plain ``strategy="ddp"`` hangs or crashes
on this; with shardplus each rank prints how many batches its stream gave and how many steps it took.
"""

import argparse

import lightning.pytorch as pl

import lightning_shardplus
from lightning_shardplus.data.uneven import NO_BATCH
from lightning_shardplus.demo import ClassifierModule, DigitsStreamDataModule


class CountBatches(pl.Callback):
    """Counts, per rank, the batches its own stream gave (a rank whose stream ran out gets ``NO_BATCH``)."""

    def __init__(self) -> None:
        self.own = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.own = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        self.own += batch is not NO_BATCH

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"rank {trainer.global_rank}: {self.own} batches of its own in the last epoch; "
              f"{trainer.global_step} steps in all", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uneven-inputs", choices=["join", "drop"], default="join")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--data-dir", default="data/digits_litdata")
    args = parser.parse_args()

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=lightning_shardplus.ShardPlusStrategy(uneven_inputs=args.uneven_inputs),
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[CountBatches()],
    )
    model = ClassifierModule(input_dim=64, num_classes=10, hidden_dims=[128])
    trainer.fit(model, DigitsStreamDataModule(data_dir=args.data_dir, global_batch_size=16 * args.devices))
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
