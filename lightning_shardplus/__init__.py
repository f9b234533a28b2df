"""lightning-shardplus: synchronous data-parallel training for PyTorch Lightning, with the optimizations of
Horovod, Determined and NVIDIA Clara Train. Importing it registers the ``shardplus*`` strategy names in every
installed Lightning namespace; ``lightning_shardplus.pytorch_lightning`` holds the same names for
``pytorch_lightning`` where ``lightning`` is installed too (``_namespace``)."""

from lightning_shardplus import _namespace

_namespace.install()  # before the first submodule: where only pytorch_lightning is installed, they are rewritten

from lightning_shardplus import _lightning  # noqa: E402
from lightning_shardplus.config import registered_names  # noqa: E402
from lightning_shardplus.datamodule import ShardPlusDataModule, SyntheticDataModule  # noqa: E402
from lightning_shardplus.model_parallel import MODEL_PARALLEL_NAMES, ShardPlusModelParallelStrategy  # noqa: E402
from lightning_shardplus.sharding import ExactShardSampler, PaddedShardSampler  # noqa: E402
from lightning_shardplus.strategy import ShardPlusStrategy  # noqa: E402

__version__ = "0.1.0"

# Lightning has no entry point for third-party strategies: register on import.
_namespace.register(ShardPlusStrategy, registered_names())
_namespace.register(ShardPlusModelParallelStrategy, MODEL_PARALLEL_NAMES)
del registered_names, MODEL_PARALLEL_NAMES
_lightning.warn_if_untested()

__all__ = [
    "ExactShardSampler", "PaddedShardSampler", "ShardPlusDataModule", "ShardPlusModelParallelStrategy",
    "ShardPlusStrategy", "SyntheticDataModule",
]  # fmt: skip
