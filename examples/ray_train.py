"""shardplus on Ray Train: the Trainer built as Ray documents its Lightning integration, with RayShardPlusStrategy.

    pip install 'lightning-shardplus[ray]'
    python examples/ray_train.py                  # a local Ray instance, 2 CPU workers
    python examples/ray_train.py --workers 3      # on a cluster: ray job submit -- python examples/ray_train.py ...

`result.metrics` (what Ray reports, rank 0's) are exact: the values of a one-process evaluation (docs/ray.md).
"""

import argparse

import lightning.pytorch as pl
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer

from lightning_shardplus.demo import ClassifierModule, DigitsDataModule
from lightning_shardplus.ray import RayShardPlusStrategy


def train_function(config: dict) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        devices="auto", accelerator="auto", strategy=RayShardPlusStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], max_epochs=config["max_epochs"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer = prepare_trainer(trainer)
    model = ClassifierModule(input_dim=64, num_classes=10, hidden_dims=[128])
    trainer.fit(model, DigitsDataModule(global_batch_size=64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--storage", default=None, help="RunConfig(storage_path=...): on a cluster, shared storage")
    args = parser.parse_args()

    trainer = TorchTrainer(  # starts a local Ray instance, or joins the cluster `ray job submit` runs on
        train_function, train_loop_config={"max_epochs": args.max_epochs},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage),
    )  # fmt: skip
    result = trainer.fit()
    print(f"final metrics: { {k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items()} }")


if __name__ == "__main__":
    main()
