"""The package's callbacks under the import path they were published at: learning-rate scaling (``large_batch.py``)
and the diagnostics (``diagnostics/``)."""

from lightning_shardplus.diagnostics import (
    STEP_PHASES,
    ScalingReport,
    VerifySharding,
    format_scaling_report,
    scaling_verdict,
    summarize_scaling,
)
from lightning_shardplus.large_batch import SCALING_RULES, ScaleLearningRate, scaling_factor, warmup_factor

__all__ = [
    "SCALING_RULES",
    "STEP_PHASES",
    "ScaleLearningRate",
    "ScalingReport",
    "VerifySharding",
    "format_scaling_report",
    "scaling_factor",
    "scaling_verdict",
    "summarize_scaling",
    "warmup_factor",
]
