"""The error raised when ranks log one training value with different reductions, and its text
(:mod:`training_metrics` raises it on every rank at the agreement on the names)."""

from __future__ import annotations

from collections.abc import Sequence


class MetricMismatchError(RuntimeError):
    """Ranks logged one name with different reductions (``reduce_fx``/``sync_dist``); raised on every rank."""


def describe_mismatch(per_rank: Sequence[Sequence[tuple[str, str, str]]], where: str) -> str:
    """The error text for ranks that reduce a name differently (``per_rank[r]``: rank r's (key, reduction, label))."""
    sets = [set(entries) for entries in per_rank]
    common = set.intersection(*sets) if sets else set()
    lines = []
    for key, reduction, label in sorted(set().union(*sets) - common):
        on = [rank for rank, entries in enumerate(sets) if (key, reduction, label) in entries]
        off = [rank for rank in range(len(sets)) if rank not in on]
        lines.append(f"{label} (reduced as {reduction}): logged on rank(s) {on}, not on rank(s) {off}")
    detail = "; ".join(lines) if lines else "the ranks' metric names differ"
    return (
        f"shardplus: ranks reduce a training metric differently at {where}, so it cannot be averaged without mixing "
        f"unrelated values: {detail}. Log a name with the same reduce_fx and sync_dist on every rank, log "
        "rank-specific values with `rank_zero_only=True`, or set `average_training_metrics=False`."
    )
