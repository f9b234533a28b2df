"""Type stub of ``lightning_shardplus.pytorch_lightning``: the package served for ``pytorch_lightning`` at import
(``_compat/namespace.py``), with the public names of ``lightning_shardplus``. tests/test_namespaces.py checks it names
every one."""

from lightning_shardplus import (
    AverageTrainingMetrics as AverageTrainingMetrics,
    CollectiveCalls as CollectiveCalls,
    CommunicationCounter as CommunicationCounter,
    CommunicationHookWrapper as CommunicationHookWrapper,
    ExactShardSampler as ExactShardSampler,
    LARS as LARS,
    MetricMismatchError as MetricMismatchError,
    PaddedShardSampler as PaddedShardSampler,
    ScaleLearningRate as ScaleLearningRate,
    ScalingReport as ScalingReport,
    ShardPlusDataModule as ShardPlusDataModule,
    ShardPlusModelParallelStrategy as ShardPlusModelParallelStrategy,
    ShardPlusStrategy as ShardPlusStrategy,
    SyntheticDataModule as SyntheticDataModule,
    VerifySharding as VerifySharding,
)
