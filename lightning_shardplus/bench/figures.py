"""``python -m lightning_shardplus.bench.figures [--check]``: docs/figures.md, every measured figure of the project,
from the reports in docs/bench/ (each with the command that wrote it). Other pages link to it; none copies a number.
``--check`` exits 1 where the page is not what the reports give (tests/test_figures.py runs it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_shardplus.bench.tables import format_fusion_table, format_table

ROOT = Path(__file__).resolve().parents[2]
BENCH, PAGE = ROOT / "docs" / "bench", ROOT / "docs" / "figures.md"


def command(name: str, report: dict[str, Any]) -> str:
    """The command that wrote ``docs/bench/<name>`` (for a pooled report: the pooling of its sources)."""
    settings = report["settings"]
    if settings.get("pooled_from"):
        sources = " ".join(settings["pooled_from"])
        return f"python -m lightning_shardplus.bench --from-json {sources} --json docs/bench/{name}"
    words = ["python -m lightning_shardplus.bench"]
    if settings.get("model_parallel"):
        words.append("--model-parallel")
    elif settings.get("fusion"):
        words.append("--fusion")
    elif settings.get("configs"):
        words.append(f"--configs {','.join(settings['configs'])}")
    words.append(f"--repeats {settings['repeats']} --steps {settings['steps']}")
    if settings.get("read_every_step"):
        words.append("--read-every-step")
    if settings.get("accelerator") not in (None, "cpu"):
        words.append(f"--accelerator {settings['accelerator']}")
    return " ".join(words + [f"--json docs/bench/{name}"])


def machine(report: dict[str, Any]) -> str:
    found = report.get("machine")
    if not found:
        return "machine not recorded"
    keys = ("cpu", "cpu_cores", "accelerator", "devices", "torch", "lightning", "python")
    return ", ".join(f"{key} {found[key]}" for key in keys if found.get(key) is not None)


def render() -> str:
    """The page, from every report in docs/bench/ (pooled reports first: the headline figures)."""
    reports = {path.name: json.loads(path.read_text()) for path in sorted(BENCH.glob("*.json"))}
    order = sorted(reports, key=lambda name: (not reports[name].get("settings", {}).get("pooled_from"), name))
    lines = [
        "# Figures",
        "",
        "Every figure measured for shardplus, generated from the reports in [bench/](bench/) by",
        "`python -m lightning_shardplus.bench.figures` (do not edit by hand; a test fails when it is stale). Each",
        "section names its report, the command that wrote it and the machine. Ratios are against plain `ddp` (or",
        "Lightning's `ModelParallelStrategy`) in the same run; how to read them: [performance](performance.md).",
    ]
    for name in order:
        report = reports[name]
        if "results" in report:
            table = format_table(report)
        elif "fusion_rows" in report:
            table = format_fusion_table(report)
        else:
            table = "(a report of its own kind: read by the page that links it)"
        lines += ["", f"## {name}", "", f"`{command(name, report)}`" if "settings" in report else "", "",
                  f"Machine: {machine(report)}.", "", table]
    return "\n".join(line for line in lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/figures.md is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        return 0 if PAGE.is_file() and PAGE.read_text() == page else 1
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
