"""The 0.1.0 import path of the training-metrics names (documented in docs/training-metrics.md)."""

from lightning_shardplus.training_metrics import AverageTrainingMetrics, MetricMismatchError  # noqa: F401
