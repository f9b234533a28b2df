"""shardplus where the model is sharded: FSDP2 over 2 data-parallel ranks x tensor parallel over 2 (4 CPU processes,
torch 2.6 or newer). The model shards itself in ``configure_model`` (``ModelParallelClassifierModule``); the strategy
keeps shardplus's data side over the data-parallel ranks (docs/model-parallel.md).

    python examples/model_parallel.py
    python examples/model_parallel.py --data-parallel 3 --tensor-parallel 1
"""

import argparse

import lightning.pytorch as pl

from lightning_shardplus import ShardPlusModelParallelStrategy
from lightning_shardplus.demo import DigitsDataModule, ModelParallelClassifierModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=5)
    args = parser.parse_args()

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.data_parallel * args.tensor_parallel,
        strategy=ShardPlusModelParallelStrategy(args.data_parallel, args.tensor_parallel),
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = ModelParallelClassifierModule(input_dim=64, num_classes=10, hidden_dims=[128])
    trainer.fit(model, DigitsDataModule(global_batch_size=64))
    (result,) = trainer.validate(model, DigitsDataModule(global_batch_size=64), verbose=False)
    if trainer.is_global_zero:
        print(f"validation accuracy {result['val_acc']:.3f} (every validation sample once)")


if __name__ == "__main__":
    main()
