"""Several reports of one command as one (``--from-json A.json B.json ...``): each row's runs and paired ratios over
all of them, where one report's 11 rounds cannot resolve a 1% difference on a noisy machine.

Example: three runs of ``--configs ddp,shardplus-plain --repeats 11 --json rK.json`` pooled give each row 33 paired
ratios, and a 95% interval of their median about half as wide as one report's."""

from __future__ import annotations

import statistics
from typing import Any

from lightning_shardplus.bench.runner import throughput_figures

# what may differ between reports pooled: where they were written, and their rendering options
_PER_REPORT_SETTINGS = ("json", "from_json", "plots", "markdown")


def pool_reports(reports: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One report of the matrix from ``reports`` (read from the files ``names``) of the same rows, baseline and
    settings: per row, every run's samples/s, the median of every paired ratio (each run over the baseline's run of
    its round in its report) with its 95% interval, and the median of the reports' ms/step. Counts and breakdowns
    are the first report's."""
    for name, report in zip(names, reports, strict=True):
        if "baseline" not in report or "results" not in report:
            raise ValueError(f"--from-json {name}: several reports pool only the matrix's (rows against a baseline)")
    first = reports[0]
    settings = {k: v for k, v in first["settings"].items() if k not in _PER_REPORT_SETTINGS}
    for name, report in zip(names[1:], reports[1:], strict=True):
        other = {k: v for k, v in report["settings"].items() if k not in _PER_REPORT_SETTINGS}
        if report["baseline"] != first["baseline"] or report["results"].keys() != first["results"].keys():
            raise ValueError(f"--from-json {name}: its rows {list(report['results'])} are not those of {names[0]}")
        if other != settings:
            changed = sorted(k for k in settings.keys() | other.keys() if settings.get(k) != other.get(k))
            raise ValueError(f"--from-json {name}: its settings differ from those of {names[0]} in {changed}")
    baseline = first["baseline"]
    baseline_median = statistics.median(r for report in reports for r in report["results"][baseline]["runs"])
    rows = {}
    for row_name, row in first["results"].items():
        per_report = [report["results"][row_name] for report in reports]
        runs = [run for own in per_report for run in own["runs"]]
        paired = [
            run / base
            for own, report in zip(per_report, reports, strict=True)
            for run, base in zip(own["runs"], report["results"][baseline]["runs"], strict=True)
        ]
        rows[row_name] = {
            **row,
            **throughput_figures(runs, paired, baseline_median),
            "median_ms_per_step": statistics.median(own["median_ms_per_step"] for own in per_report),
            "paired_ratio_per_report": [own["paired_ratio_to_baseline"] for own in per_report],
        }
    return {**first, "settings": {**settings, "pooled_from": names}, "results": rows}
