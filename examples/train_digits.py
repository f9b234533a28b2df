"""Plain-Trainer use of lightning-shardplus: the only change to a Lightning script is the strategy.

    python examples/train_digits.py                 # strategy="shardplus" on 2 CPU processes
    python examples/train_digits.py --instance      # the same with a configured ShardPlusStrategy

scikit-learn's digits ship inside the package: nothing is downloaded.
"""

import argparse

import lightning.pytorch as pl

import lightning_shardplus  # registers strategy="shardplus"
from lightning_shardplus.demo import ClassifierModule, DigitsDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instance", action="store_true", help="pass a ShardPlusStrategy instance")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--max-steps", type=int, default=-1)
    args = parser.parse_args()

    pl.seed_everything(0)
    strategy = (
        lightning_shardplus.ShardPlusStrategy(shard_padding="wrap", verify_sharding=True)
        if args.instance
        else "shardplus"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = ClassifierModule(input_dim=64, num_classes=10, hidden_dims=[128])
    trainer.fit(model, DigitsDataModule(global_batch_size=64))
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
