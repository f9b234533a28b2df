"""The communication counters under the import path 0.1.0 published (``lightning_shardplus.instrumentation``); they
live in ``lightning_shardplus.diagnostics.counting``."""

from lightning_shardplus.diagnostics.counting import (
    CollectiveCalls,
    CommunicationCounter,
    CommunicationHookWrapper,
    ObservedProcessGroup,
)

__all__ = ["CollectiveCalls", "CommunicationCounter", "CommunicationHookWrapper", "ObservedProcessGroup"]
