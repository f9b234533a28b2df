"""lightning-shardplus: synchronous data-parallel training for PyTorch Lightning, with the optimizations of
Horovod, Determined and NVIDIA Clara Train. Importing it registers the ``shardplus*`` strategy names."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shardplus.datamodule import ShardPlusDataModule, SyntheticDataModule
from lightning_shardplus.sharding import ExactShardSampler, PaddedShardSampler
from lightning_shardplus.strategy import ShardPlusStrategy

__version__ = "0.1.0"

# Lightning has no entry point for third-party strategies: register on import.
ShardPlusStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ExactShardSampler",
    "PaddedShardSampler",
    "ShardPlusDataModule",
    "ShardPlusStrategy",
    "SyntheticDataModule",
]
