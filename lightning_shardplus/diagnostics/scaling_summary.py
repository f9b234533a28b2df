"""The scaling report's figures from each rank's phase totals (milliseconds and shares per phase, samples/s,
efficiency, a verdict) and the report as text: pure functions, no Lightning, no process group."""

from __future__ import annotations

import statistics
from typing import Any

STEP_PHASES: tuple[str, ...] = ("data", "between_steps", "forward", "backward", "communication", "optimizer")
"""The phases a training micro-batch is cut into, in the order they happen."""


def summarize_scaling(
    per_rank: list[dict[str, float]], threshold: float = 0.2, single_device_samples_per_second: float | None = None,
    micro_batches_per_step: int = 1, timing: str = "host", gradient_compression: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The report of :class:`ScalingReport` from each rank's totals (seconds per phase, samples, micro-batches):
    per-micro-batch milliseconds and shares of each phase (means over ranks), samples/s, efficiency, verdict.
    ``timing``: the clock of the figures (``"host"`` or ``"<device> events"``); ``gradient_compression``: the
    strategy's, so that the advice names what is not in use yet."""
    world_size = len(per_rank)
    counted = [rank for rank in per_rank if rank["micro_batches"] > 0]
    if not counted:
        verdict = "no training step was counted (fewer steps than `skip_first_steps`)"
        return {"world_size": world_size, "micro_batches": 0, "verdict": verdict}
    ms_per_micro_batch = {
        phase: statistics.fmean(1000 * rank[phase] / rank["micro_batches"] for rank in counted) for phase in STEP_PHASES
    }
    step_ms = sum(ms_per_micro_batch.values())
    fractions = {phase: (ms / step_ms if step_ms > 0 else 0.0) for phase, ms in ms_per_micro_batch.items()}
    slowest = max(sum(rank[phase] for phase in STEP_PHASES) for rank in counted)
    samples = sum(rank["samples"] for rank in counted)
    samples_per_second = samples / slowest if slowest > 0 and samples > 0 else None
    known = samples_per_second is not None and single_device_samples_per_second
    efficiency = samples_per_second / (world_size * single_device_samples_per_second) if known else None
    report = {
        "world_size": world_size, "micro_batches": int(min(rank["micro_batches"] for rank in counted)),
        "micro_batches_per_optimizer_step": micro_batches_per_step, "ms_per_micro_batch": ms_per_micro_batch,
        "fractions": fractions, "samples_per_second": samples_per_second,
        "single_device_samples_per_second": single_device_samples_per_second, "scaling_efficiency": efficiency,
        "timing": timing, "gradient_compression": gradient_compression, "per_rank": per_rank,
    }  # fmt: skip
    report["verdict"] = scaling_verdict(report, threshold)
    return report


def scaling_verdict(report: dict[str, Any], threshold: float = 0.2) -> str:
    """One line on what limits scaling: data loading, exposed communication or the time between steps when any
    takes at least ``threshold`` of a step (the largest first), else the computation."""
    fractions = report["fractions"]
    efficiency = report.get("scaling_efficiency")
    suffix = "" if efficiency is None else f"; scaling efficiency {efficiency:.0%}"
    advice = {
        "data": "data loading takes {:.0%} of each step: raise num_workers, set pin_memory/persistent_workers, "
        "or check with SyntheticDataModule that the model scales without your data",
        "communication": "gradient communication not hidden behind backward takes {:.0%} of each step: try "
        + _communication_options(report),
        "between_steps": "the time between steps takes {:.0%} of each step (moving batches to the device, logging, "
        "checkpointing, callbacks, waiting for a slower rank): log less often, or look for the slow rank",
    }
    limits = sorted((phase for phase in advice if fractions[phase] >= threshold), key=lambda p: -fractions[p])
    if limits:
        return "; ".join(advice[phase].format(fractions[phase]) for phase in limits) + suffix
    compute = fractions["forward"] + fractions["backward"] + fractions["optimizer"]
    return f"compute-bound: forward/backward/optimizer take {compute:.0%} of each step" + suffix


def _communication_options(report: dict[str, Any]) -> str:
    """What would cut exposed communication, leaving out what the run already does."""
    options = []
    compression = report.get("gradient_compression")
    if compression in (None, "none"):
        options.append("gradient_compression ('fp16', 'powersgd')")
    elif compression != "powersgd":
        options.append("gradient_compression='powersgd'")
    micro_batches = report.get("micro_batches_per_optimizer_step", 1)
    options.append("aggregation_frequency > 1" if micro_batches == 1 else f"aggregation_frequency > {micro_batches}")
    options.append("another tensor_fusion_threshold_mb (or auto_tune_tensor_fusion)")
    return ", ".join(options[:-1]) + ", or " + options[-1]


def format_scaling_report(report: dict[str, Any]) -> str:
    """The report as a few aligned lines: milliseconds and share of each phase, samples/s, efficiency."""
    if not report.get("micro_batches"):
        return report["verdict"]
    lines = [
        f"{phase:>13}: {report['ms_per_micro_batch'][phase]:9.2f} ms/step {report['fractions'][phase]:6.1%}"
        for phase in STEP_PHASES
    ]
    rate = report["samples_per_second"]
    lines.append(f"{'samples/s':>13}: " + ("unknown" if rate is None else f"{rate:.1f}"))
    lines.append(f"{'ranks':>13}: {report['world_size']}, {report['micro_batches']} steps counted per rank")
    timing = report.get("timing", "host")
    lines.append(f"{'timed with':>13}: " + ("the host's wall clock" if timing == "host" else timing))
    if report["scaling_efficiency"] is not None:
        lines.append(f"{'efficiency':>13}: {report['scaling_efficiency']:.1%}")
    return "\n".join(lines)


def loggable_figures(report: dict[str, Any]) -> dict[str, float]:
    """The report's figures that a logger takes: per phase milliseconds and share, samples/s, efficiency."""
    figures: dict[str, float] = {}
    for phase in STEP_PHASES:
        figures[f"{phase}_ms"] = report["ms_per_micro_batch"][phase]
        figures[f"{phase}_fraction"] = report["fractions"][phase]
    for key in ("samples_per_second", "scaling_efficiency"):
        if report.get(key) is not None:
            figures[key] = report[key]
    return figures
