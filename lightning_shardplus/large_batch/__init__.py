"""The large-batch recipe: the learning rate scaled with the effective batch, with warmup, and LARS."""

from lightning_shardplus.large_batch.lars import LARS
from lightning_shardplus.large_batch.scaling import ScaleLearningRate

__all__ = ["LARS", "ScaleLearningRate"]
