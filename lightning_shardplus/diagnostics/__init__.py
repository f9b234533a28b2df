"""Diagnostics that run beside training: where a step's time goes (:class:`ScalingReport`, on a step clock), what the
gradient communication sends (:class:`CommunicationCounter`, :class:`CollectiveCalls`) and whether the training
shards were right (:class:`VerifySharding`, ``verify_sharding=True``)."""

from lightning_shardplus.data.verify_sharding import VerifySharding
from lightning_shardplus.diagnostics.counting import (
    CollectiveCalls,
    CommunicationCounter,
    CommunicationHookWrapper,
    ObservedProcessGroup,
)
from lightning_shardplus.diagnostics.scaling_report import ScalingReport
from lightning_shardplus.diagnostics.scaling_summary import (
    STEP_PHASES,
    format_scaling_report,
    scaling_verdict,
    summarize_scaling,
)

__all__ = [
    "STEP_PHASES",
    "CollectiveCalls",
    "CommunicationCounter",
    "CommunicationHookWrapper",
    "ObservedProcessGroup",
    "ScalingReport",
    "VerifySharding",
    "format_scaling_report",
    "scaling_verdict",
    "summarize_scaling",
]
