"""Type stub of ``lightning_shardplus.pytorch_lightning``: the package served for ``pytorch_lightning`` at import
(``_compat/namespace.py``), with the public names of ``lightning_shardplus``. tests/test_namespaces.py checks it names
every one."""

from lightning_shardplus import (
    LARS as LARS,
)
from lightning_shardplus import (
    AverageTrainingMetrics as AverageTrainingMetrics,
)
from lightning_shardplus import (
    CollectiveCalls as CollectiveCalls,
)
from lightning_shardplus import (
    CommunicationCounter as CommunicationCounter,
)
from lightning_shardplus import (
    CommunicationHookWrapper as CommunicationHookWrapper,
)
from lightning_shardplus import (
    ExactShardSampler as ExactShardSampler,
)
from lightning_shardplus import (
    MetricMismatchError as MetricMismatchError,
)
from lightning_shardplus import (
    PaddedShardSampler as PaddedShardSampler,
)
from lightning_shardplus import (
    ScaleLearningRate as ScaleLearningRate,
)
from lightning_shardplus import (
    ScalingReport as ScalingReport,
)
from lightning_shardplus import (
    ShardPlusDataModule as ShardPlusDataModule,
)
from lightning_shardplus import (
    ShardPlusModelParallelStrategy as ShardPlusModelParallelStrategy,
)
from lightning_shardplus import (
    ShardPlusStrategy as ShardPlusStrategy,
)
from lightning_shardplus import (
    SyntheticDataModule as SyntheticDataModule,
)
from lightning_shardplus import (
    VerifySharding as VerifySharding,
)
