"""The reports as Markdown tables (the matrix, the step breakdown, the sampler and fusion rows), the README's
performance section, and the matrix's two plots."""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

from lightning_shardplus.bench.fusion import FUSION_REFERENCE_RUN_STEPS
from lightning_shardplus.diagnostics import STEP_PHASES

PLOT_DPI = 100
PLOT_SIZE = (1000, 500)  # pixels


def _count(value: float | None, unit: str = "") -> str:
    """A counted figure for a table cell: "-" when not counted, bytes in kB or MB."""
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 1e6:.3f} MB" if value >= 1e5 else f"{value / 1e3:.1f} kB"
    return f"{value:g}"


# fewer runs per row than this, and the ratios to the baseline are within the run-to-run noise of this benchmark
# (and the paired ratio has no 95% interval: `runner.median_interval` needs 6)
SIGNIFICANT_RUNS = 6

# what the matrix's row names mean (plots' caption)
ROW_MEANINGS = {
    "ddp": 'strategy="ddp" (the baseline)',
    "shardplus": "shardplus defaults",
    "shardplus-plain": "shardplus, average_training_metrics=False",
    "ddp-stream": "ddp on a stream per rank (equal lengths)",
    "shardplus-stream": "shardplus on a stream per rank (uneven_inputs agreement)",
    "shardplus-report": "shardplus + ScalingReport",
    "none": "shardplus, Python all-reduce hook (gradients counted)",
    "agg4": "4 micro-batches per optimizer step",
    "agg8": "8 micro-batches per optimizer step",
    "fp16": "fp16 gradient compression",
    "bf16": "bf16 gradient compression",
    "powersgd": "PowerSGD gradient compression",
    "autotune": "tuned bucket size (from the cache)",
    "metrics16-*": "16 scalars logged per step",
}


def noise_note(report: dict[str, Any]) -> str | None:
    """A line saying the ratios are within noise when a row has fewer than :data:`SIGNIFICANT_RUNS` runs."""
    runs = min(len(row["runs"]) for row in report["results"].values())
    if runs >= SIGNIFICANT_RUNS:
        return None
    return (
        f"fewer than {SIGNIFICANT_RUNS} runs per row ({runs}): ratios are not significant (within the run-to-run "
        f"noise; use --repeats={SIGNIFICANT_RUNS} or more)"
    )


def format_table(report: dict[str, Any]) -> str:
    """The matrix: per row, samples/s, its ratio to the baseline and the counted communication per step; below
    it, :func:`noise_note` where the runs are too few for the ratios to mean anything."""
    lines = [
        f"| configuration | samples/s (median) | min - max | ms/step (median) | ratio to {report['baseline']} | "
        "paired ratio (median, 95% interval) | gradient bytes / step | all-reduce rounds / step | "
        "collectives in hooks / step | all_reduce calls / step | barrier calls / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["results"].items():
        paired = row.get("paired_ratio_to_baseline")  # absent from reports written before it was measured
        interval = row.get("paired_ratio_interval_95")  # likewise; None with fewer than 6 runs
        paired_cell = "-" if paired is None else f"{paired:.3f}"
        if interval is not None:
            paired_cell += f" ({interval[0]:.3f} - {interval[1]:.3f})"
        lines.append(
            f"| {name} | {row['median_samples_per_s']:.0f} | {row['min_samples_per_s']:.0f} - "
            f"{row['max_samples_per_s']:.0f} | {row['median_ms_per_step']:.1f} | {row['ratio_to_baseline']:.3f} | "
            f"{paired_cell} | "
            f"{_count(row['bytes_per_step'], 'bytes')} | "
            f"{_count(row['rounds_per_step'])} | {_count(row['collectives_per_step'])} | "
            f"{_count(row['all_reduce_per_step'])} | {_count(row['barrier_per_step'])} |"
        )
    notes = [note for note in (pooled_note(report), noise_note(report)) if note is not None]
    return "\n".join(lines + ([""] if notes else []) + notes)


def pooled_note(report: dict[str, Any]) -> str | None:
    """For a report pooled from several (``--from-json A B ...``): from which, and each one's paired medians."""
    sources = report.get("settings", {}).get("pooled_from")
    if not sources:
        return None
    medians = "; ".join(
        f"{name} " + ", ".join(f"{ratio:.3f}" for ratio in row["paired_ratio_per_report"])
        for name, row in report["results"].items()
        if name != report["baseline"]
    )
    return f"pooled from {len(sources)} reports ({', '.join(sources)}); each one's paired ratio: {medians}"


def format_breakdown_table(report: dict[str, Any]) -> str:
    """Milliseconds per micro-batch in each phase (ScalingReport, median over the runs) for the rows that ran it."""
    lines = [
        "| configuration | " + " | ".join(phase.replace("_", " ") for phase in STEP_PHASES) + " | total |",
        "|---|" + "---:|" * (len(STEP_PHASES) + 1),
    ]
    for name, row in report["results"].items():
        breakdown = row.get("breakdown_ms_per_micro_batch")
        if breakdown:
            cells = " | ".join(f"{breakdown[phase]:.2f}" for phase in STEP_PHASES)
            lines.append(f"| {name} | {cells} | {sum(breakdown.values()):.2f} |")
    return "\n".join(lines)


def report_overhead(report: dict[str, Any]) -> dict[str, float] | None:
    """ScalingReport's cost, two ways. ``paired``: 1 - the median over repeats of samples/s of ``shardplus-report``
    / ``shardplus`` in the same repeat (run next to each other: the machine's drift cancels), with the range of
    those ratios; ``own_work``: :func:`measure_report_cost` as a share of ``shardplus-report``'s time per
    micro-batch. None without both rows."""
    rows = report["results"]
    if "shardplus" not in rows or "shardplus-report" not in rows:
        return None
    ratios = [a / b for a, b in zip(rows["shardplus-report"]["runs"], rows["shardplus"]["runs"], strict=True)]
    overhead = {"paired": 1 - statistics.median(ratios), "paired_min": 1 - max(ratios), "paired_max": 1 - min(ratios)}
    cost = report.get("scaling_report_cost_us_per_micro_batch")
    breakdown = rows["shardplus-report"].get("breakdown_ms_per_micro_batch")
    if cost is not None and breakdown:
        overhead["own_work"] = cost / (1000 * sum(breakdown.values()))
    return overhead


def _fewer(share: float) -> str:
    """A relative loss of samples/s in words: ``0.05`` is "5.0% fewer", ``-0.05`` "5.0% more"."""
    return f"{share:.1%} fewer" if share >= 0 else f"{-share:.1%} more"


def format_overhead(report: dict[str, Any]) -> str | None:
    """One sentence on :func:`report_overhead`; None without the two rows."""
    overhead = report_overhead(report)
    if overhead is None:
        return None
    text = (
        f"`ScalingReport` overhead: {_fewer(overhead['paired'])} samples/s for `shardplus-report` than `shardplus` "
        f"(median of {len(report['results']['shardplus']['runs'])} paired runs; from {_fewer(overhead['paired_min'])} "
        f"to {_fewer(overhead['paired_max'])})"
    )
    if "own_work" in overhead:
        text += (
            f"; its own work, timed alone, is at most {report['scaling_report_cost_us_per_micro_batch']:.1f} us per "
            f"micro-batch, {overhead['own_work']:.2%} of a step"
        )
    return text + "."


def format_markdown(report: dict[str, Any]) -> str:
    """The section of docs/performance.md: the machine, the command's settings, the two tables, the overhead."""
    settings, description = report["settings"], report.get("machine", {})
    gpu = f", {description['gpu']}" if description.get("gpu") else ""
    flags = " --quick" if settings.get("quick") else ""
    lines = [
        "### Benchmark matrix",
        "",
        f"Generated by `python -m lightning_shardplus.bench{flags} --markdown` on {description.get('cpu', '?')} "
        f"({description.get('cpu_cores', '?')} cores{gpu}), {settings['devices']} {settings.get('accelerator', 'cpu')} "
        f"processes, torch {description.get('torch', '?')}, Lightning {description.get('lightning', '?')}: "
        f"an MLP {settings['input_dim']} -> {settings['layers']} x {settings['hidden_dim']} -> 10, global batch "
        f"{settings['global_batch_size']}, {settings['steps']} timed micro-batches after {settings['warmup']} "
        f"untimed, {settings['repeats']} runs per row alternating.",
        "",
        format_table(report),
        "",
        "Time per micro-batch by phase (ms, `ScalingReport`, median over the runs):",
        "",
        format_breakdown_table(report),
    ]
    overhead = format_overhead(report)
    if overhead is not None:
        lines += ["", overhead]
    return "\n".join(lines)


def write_plots(report: dict[str, Any], directory: Path) -> list[Path]:
    """Two PNGs of ``PLOT_SIZE`` pixels in ``directory``: samples/s per row (median bar, every run as a dot) and
    the time per micro-batch by phase (stacked). Needs matplotlib (``pip install lightning-shardplus[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit("--plots needs matplotlib: pip install 'lightning-shardplus[bench]'") from err
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "samples_per_second.png", directory / "step_breakdown.png"]
    for path, draw in zip(paths, (_plot_samples_per_second, _plot_step_breakdown), strict=True):
        width, height = PLOT_SIZE
        figure, axes = plt.subplots(figsize=(width / PLOT_DPI, height / PLOT_DPI), dpi=PLOT_DPI, layout="constrained")
        draw(axes, report)
        figure.savefig(path, dpi=PLOT_DPI)
        plt.close(figure)
    return paths


def _plot_samples_per_second(axes: Any, report: dict[str, Any]) -> None:
    """Samples/s per row: the median as a bar, every run as a dot."""
    rows = report["results"]
    names = list(rows)
    axes.bar(names, [rows[n]["median_samples_per_s"] for n in names], color="#4c72b0", label="median")
    for index, name in enumerate(names):
        runs = rows[name]["runs"]
        axes.plot([index] * len(runs), runs, "o", color="black", markersize=3, label="runs" if index == 0 else None)
    baseline = report["baseline"]
    axes.axhline(rows[baseline]["median_samples_per_s"], color="#c44e52", linestyle="--", label=f"{baseline} = 1.0x")
    axes.set_ylabel("samples/s")
    axes.set_title(f"Samples/s per configuration ({report['settings']['devices']} processes; bars: median)")
    axes.tick_params(axis="x", labelrotation=60)
    axes.set_xlabel(_caption(names, report), fontsize="x-small", wrap=True)
    axes.legend()


def _caption(names: list[str], report: dict[str, Any]) -> str:
    """What the plotted row names mean, and the noise note where it applies."""
    keys = dict.fromkeys("metrics16-*" if name.startswith("metrics16-") else name for name in names)
    text = "; ".join(f"{key}: {ROW_MEANINGS[key]}" for key in keys if key in ROW_MEANINGS)
    lines = textwrap.wrap(text, 180)
    note = noise_note(report)
    return "\n".join(lines + ([note] if note else []))


def _plot_step_breakdown(axes: Any, report: dict[str, Any]) -> None:
    """The time per micro-batch by phase, stacked, for the rows that ran a ScalingReport."""
    rows = report["results"]
    broken = [n for n in rows if rows[n].get("breakdown_ms_per_micro_batch")]
    left = [0.0] * len(broken)
    for phase in STEP_PHASES:
        values = [rows[n]["breakdown_ms_per_micro_batch"][phase] for n in broken]
        axes.barh(broken, values, left=left, label=phase.replace("_", " "))
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.invert_yaxis()
    axes.set_xlabel("ms per micro-batch (median over runs)")
    axes.set_title("Where each step's time goes (ScalingReport)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(STEP_PHASES), fontsize="small")


def format_sampler_table(report: dict[str, Any]) -> str:
    """The ``--sampler`` rows: time to the first index, indices/s and peak memory per length and sampler."""
    lines = [
        "| N | sampler | first index | indices/s per rank (after the first) | indices/s per rank (whole pass) "
        "| peak memory |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in report["sampler_rows"]:
        rate = "-" if row["indices_per_s"] is None else f"{row['indices_per_s'] / 1e6:.1f} M"
        whole = row.get("indices_per_s_with_setup")  # absent from reports saved by earlier versions
        rate += " | -" if whole is None else f" | {whole / 1e6:.1f} M"
        memory = "-" if row["peak_memory_mb"] is None else f"{row['peak_memory_mb']:.0f} MB"
        lines.append(
            f"| {_length_text(row['length'])} | {row['sampler']} | {row['first_index_ms']:.2f} ms | {rate} | {memory} |"
        )
    return "\n".join(lines)


def _length_text(length: int) -> str:
    """``10^k`` for a power of ten from 1000 on, else the number."""
    power = len(str(length)) - 1
    return f"10^{power}" if length == 10**power and power >= 3 else str(length)


def format_fusion_table(report: dict[str, Any]) -> str:
    """The ``--fusion`` rows: per shape, the tuned setting against the fixed ones and what tuning cost."""
    lines = [
        "| shape | parameters | tuned | best fixed | tuned / best fixed (throughput; paired) "
        "| tuned / DDP default: 25 MB, first bucket 1 MB (paired) | tuned / uniform 25 MB (paired) "
        "| control: tuned / tuned again (paired) | tuning steps "
        f"| tuning cost (of a {FUSION_REFERENCE_RUN_STEPS}-step run) | ms/step per setting |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["fusion_rows"]:
        times = ", ".join(f"{label}: {ms:.1f}" for label, ms in row["ms_per_step"].items())
        uniform = (
            f"{row['tuned_vs_uniform_25']:.3f} ({row['tuned_vs_uniform_25_paired']:.3f})"
            if row["tuned_vs_uniform_25"] is not None
            else "-"
        )
        lines.append(
            f"| {row['shape']} | {row['parameters'] / 1e6:.2f}M | {row['tuned']} | {row['best_fixed']} | "
            f"{row['tuned_vs_best_fixed']:.3f} ({row['tuned_vs_best_fixed_paired']:.3f}) | "
            f"{row['tuned_vs_default']:.3f} ({row['tuned_vs_default_paired']:.3f}) | {uniform} | "
            f"{row['tuned_vs_itself']:.3f} ({row['tuned_vs_itself_paired']:.3f}) | "
            f"{row['tuning_steps']} | "
            f"{100 * row['tuning_cost_of_2000_steps']:.2f}% | {times} |"
        )
    return "\n".join(lines)
