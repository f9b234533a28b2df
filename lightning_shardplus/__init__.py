"""lightning-shardplus: synchronous data-parallel training for PyTorch Lightning, with the optimizations of
Horovod, Determined and NVIDIA Clara Train. Importing it registers the ``shardplus*`` strategy names in every
installed Lightning namespace; ``lightning_shardplus.pytorch_lightning`` holds the same names for
``pytorch_lightning`` where ``lightning`` is installed too (``_compat/namespace.py``).

Every class a user's code or YAML names is importable from here; the sub-package paths are the code's own."""

from lightning_shardplus._compat import namespace as _namespace

_namespace.install()  # before the first submodule: where only pytorch_lightning is installed, they are rewritten

from lightning_shardplus._compat import lightning as _lightning  # noqa: E402
from lightning_shardplus.data.datamodule import ShardPlusDataModule, SyntheticDataModule  # noqa: E402
from lightning_shardplus.data.sharding import ExactShardSampler, PaddedShardSampler  # noqa: E402
from lightning_shardplus.data.training_metrics.callback import AverageTrainingMetrics  # noqa: E402
from lightning_shardplus.data.training_metrics.errors import MetricMismatchError  # noqa: E402
from lightning_shardplus.data.verify_sharding import VerifySharding  # noqa: E402
from lightning_shardplus.diagnostics import (  # noqa: E402
    CollectiveCalls,
    CommunicationCounter,
    CommunicationHookWrapper,
    ScalingReport,
)
from lightning_shardplus.large_batch import LARS, ScaleLearningRate  # noqa: E402
from lightning_shardplus.strategies import registry as _registry  # noqa: E402
from lightning_shardplus.strategies.ddp import ShardPlusStrategy  # noqa: E402
from lightning_shardplus.strategies.model_parallel import ShardPlusModelParallelStrategy  # noqa: E402

__version__ = "0.1.0"

_namespace.register(ShardPlusStrategy, _registry.entries(ShardPlusStrategy.strategy_name))
_namespace.register(ShardPlusModelParallelStrategy, _registry.entries(ShardPlusModelParallelStrategy.strategy_name))
_lightning.warn_if_untested()

__all__ = [
    "LARS", "AverageTrainingMetrics", "CollectiveCalls", "CommunicationCounter", "CommunicationHookWrapper",
    "ExactShardSampler", "MetricMismatchError", "PaddedShardSampler", "ScaleLearningRate", "ScalingReport",
    "ShardPlusDataModule", "ShardPlusModelParallelStrategy", "ShardPlusStrategy", "SyntheticDataModule",
    "VerifySharding",
]  # fmt: skip
