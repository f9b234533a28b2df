"""Draw the documentation's figures as small SVG files, byte for byte the same on every run.

    python docs/figures/draw.py [--bench docs/bench/full-2cpu.json] [--out docs/figures]

- ``padded-vs-exact-shards.svg``: 10 samples over 3 ranks, training shards (``PaddedShardSampler``) against
  evaluation shards (``ExactShardSampler``), from the samplers themselves (:func:`shard_assignment`).
- ``join-vs-drop.svg``: streams of 5, 3 and 2 batches on 3 ranks under ``uneven_inputs="join"`` and ``"drop"``.
- ``step-time.svg``: a benchmark report's time per micro-batch by phase (``ScalingReport``), drawn by the benchmark's
  own plotting code (``lightning_shardplus.bench.tables``).

Matplotlib only, no network. Determinism: fixed font sizes, text kept as SVG text, ``svg.hashsalt`` fixed (the ids
of clip paths) and no date in the metadata.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_BENCH = HERE.parent / "bench" / "full-2cpu.json"

# the shard picture's example: a dataset of N samples over W ranks, epoch 0's order shuffled with this seed (with
# seed 1 the order's first two samples, what "wrap" pads with, are not sample 0, what "first" pads with)
SAMPLES, RANKS, SEED, EPOCH = 10, 3, 1, 0
# the uneven picture's example: batches in each rank's stream
STREAM_LENGTHS = (5, 3, 2)

RC = {
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 11,
    "svg.fonttype": "none",  # text as <text>: small files, no glyph outlines
    "svg.hashsalt": "lightning-shardplus-figures",
    "path.simplify": False,
}
RANK_COLORS = ("#a6c8ea", "#f6c79b", "#a9d8a4")  # rank 0, 1, 2 (light: the index in the cell stays readable)
NO_DATA_COLOR, DROPPED_COLOR, HATCH_COLOR = "#eeeeee", "#ffffff", "#777777"


def shard_assignment(
    samples: int = SAMPLES, ranks: int = RANKS, *, seed: int = SEED, epoch: int = EPOCH, shuffle: bool = True
) -> dict[str, list[list[tuple[int, bool]]]]:
    """What the shard picture draws, per rank: ``(index, is_padding)`` for each index the rank reads, asked from the
    samplers. Keys: ``"first"`` and ``"wrap"`` (training, ``PaddedShardSampler`` with that padding, epoch ``epoch``
    of a shuffled order) and ``"exact"`` (evaluation, ``ExactShardSampler`` in dataset order)."""
    from lightning_shardplus import ExactShardSampler, PaddedShardSampler

    drawn: dict[str, list[list[tuple[int, bool]]]] = {}
    for padding in ("first", "wrap"):
        drawn[padding] = []
        for rank in range(ranks):
            sampler = PaddedShardSampler(samples, ranks, rank, shuffle=shuffle, seed=seed, padding=padding)
            sampler.set_epoch(epoch)
            indices = list(sampler)
            drawn[padding].append([(index, j >= sampler.num_real_samples) for j, index in enumerate(indices)])
    drawn["exact"] = [[(index, False) for index in ExactShardSampler(samples, ranks, rank)] for rank in range(ranks)]
    return drawn


def epoch_order(samples: int = SAMPLES, *, seed: int = SEED, epoch: int = EPOCH) -> list[int]:
    """The epoch's global order of the training picture (the permutation both training panels read)."""
    from lightning_shardplus.data.sharding import epoch_permutation

    return epoch_permutation(samples, seed=seed, epoch=epoch).tolist()


def _cell(axes: Any, x: float, y: float, text: str, color: str, *, hatch: bool = False, dashed: bool = False,
          sub: str | None = None, faded: bool = False, width: float = 1.0) -> None:
    """One box in a slot of ``width`` x 0.8 at ``(x, y)`` (lower left) with ``text`` in it and ``sub`` under it;
    ``hatch``: striped (padding); ``faded``: grey text and border."""
    if hatch:  # the stripes take the edge colour: a light one here, the border drawn over them
        axes.add_patch(Rectangle((x + 0.05, y), width - 0.1, 0.8, facecolor=color, edgecolor=HATCH_COLOR, linewidth=0,
                                 hatch="////"))
    axes.add_patch(Rectangle(
        (x + 0.05, y), width - 0.1, 0.8, facecolor="none" if hatch else color,
        edgecolor="#999999" if faded else "#333333", linewidth=1.0, linestyle="--" if dashed else "-",
    ))
    style = {"ha": "center", "va": "center", "color": "#999999" if faded else "#000000"}
    if hatch:  # the text on a patch of the cell's colour, over the stripes
        style["bbox"] = {"facecolor": color, "edgecolor": "none", "pad": 0.5}
    if sub is None:
        axes.text(x + width / 2, y + 0.4, text, fontsize=10, **style)
    else:
        axes.text(x + width / 2, y + 0.52, text, fontsize=10, **style)
        axes.text(x + width / 2, y + 0.18, sub, fontsize=7, **style)


def _rank_labels(axes: Any, x: float, rows: list[float]) -> None:
    for rank, y in enumerate(rows):
        axes.text(x, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=9)


def draw_shards(path: Path) -> None:
    """``padded-vs-exact-shards.svg``: epoch 0's order, the training shards padded with ``"first"`` and with
    ``"wrap"``, and the exact evaluation shards."""
    drawn, order = shard_assignment(), epoch_order()
    per_rank = len(drawn["first"][0])
    total = per_rank * RANKS
    figure, axes = plt.subplots(figsize=(10, 5.2))
    axes.set_xlim(-1.6, 17.2)
    axes.set_ylim(-1.5, 7.1)
    axes.set_aspect("equal")
    axes.axis("off")

    # top: the epoch's order, position p read by rank p % W; positions N .. W * ceil(N/W) - 1 are padding
    axes.text(-1.5, 6.75, f"Training (PaddedShardSampler): epoch {EPOCH}'s order of the {SAMPLES} samples, "
              f"shuffled (seed {SEED}); rank r reads positions r, r + {RANKS}, r + {2 * RANKS}, ...", fontsize=10,
              va="center")
    axes.text(-0.1, 6.05, "position", ha="right", va="center", fontsize=8, color="#555555")
    axes.text(-0.1, 5.2, "sample", ha="right", va="center", fontsize=9)
    for position in range(total):
        axes.text(position + 0.5, 6.05, str(position), ha="center", va="center", fontsize=8, color="#555555")
        color = RANK_COLORS[position % RANKS]
        if position < SAMPLES:
            _cell(axes, position, 4.8, str(order[position]), color)
        else:
            _cell(axes, position, 4.8, "pad", color, hatch=True)
    axes.text(total + 0.15, 5.2, f"positions {SAMPLES} - {total - 1}:\npadding", va="center", fontsize=8)

    rows = [2.6 - 1.0 * rank for rank in range(RANKS)]
    panels = (
        (0.0, "first", f'shard_padding="first" (default):\nceil({SAMPLES}/{RANKS}) = {per_rank} samples per rank'),
        (5.6, "wrap", f'shard_padding="wrap":\n{per_rank} samples per rank'),
        (11.6, "exact", f"Evaluation (ExactShardSampler):\n{SAMPLES} = "
         + " + ".join(str(len(shard)) for shard in drawn["exact"]) + " samples, no padding"),
    )
    for x0, key, title in panels:
        axes.text(x0 - 1.3, 3.95, title, fontsize=9, va="center")
        _rank_labels(axes, x0 - 0.1, rows)
        for rank, y in enumerate(rows):
            for j, (index, padding) in enumerate(drawn[key][rank]):
                _cell(axes, x0 + j, y, str(index), RANK_COLORS[rank], hatch=padding, sub="pad" if padding else None)
    notes = (
        f"Training: every rank reads ceil(N / W) samples and takes the same number of steps; the {total - SAMPLES} "
        "padding reads are",
        '"first": the dataset\'s first sample (index 0); "wrap": the first samples of the epoch\'s order again.',
        "Evaluation: contiguous blocks in dataset order, sizes differing by at most one: every sample once, "
        "no padding.",
    )
    for line, text in enumerate(notes):
        axes.text(-1.5, -0.5 - 0.4 * line, text, fontsize=8)
    _save(figure, path)


def draw_join_drop(path: Path, lengths: tuple[int, ...] = STREAM_LENGTHS) -> None:
    """``join-vs-drop.svg``: each rank's stream step by step under ``"join"`` (every batch trained; a rank that ran
    out trains on no data) and ``"drop"`` (every rank stops at the shortest stream), one above the other."""
    longest, shortest, step_width = max(lengths), min(lengths), 1.8
    figure, axes = plt.subplots(figsize=(8, 6))
    axes.set_xlim(-1.6, longest * step_width + 0.2)
    axes.set_ylim(-3.1, 7.4)
    axes.set_aspect("equal")
    axes.axis("off")
    panels = (
        (7.0, "join", f'uneven_inputs="join" (default): {longest} steps, every batch trained once'),
        (2.7, "drop", f'uneven_inputs="drop": {shortest} steps, the batches after them not trained'),
    )
    for top, mode, title in panels:
        rows = [top - 1.4 - 1.0 * rank for rank in range(len(lengths))]
        axes.text(-1.5, top, title, fontsize=10, va="center")
        _rank_labels(axes, -0.1, rows)
        steps = longest if mode == "join" else shortest
        for step in range(steps):
            axes.text((step + 0.5) * step_width, top - 0.45, f"step {step + 1}", ha="center", va="center",
                      fontsize=8, color="#555555")
        for rank, (y, length) in enumerate(zip(rows, lengths, strict=True)):
            for step in range(longest):
                x = step * step_width
                if step < min(length, steps):
                    _cell(axes, x, y, f"batch {step + 1}", RANK_COLORS[rank], width=step_width)
                elif mode == "join":
                    _cell(axes, x, y, "no data", NO_DATA_COLOR, dashed=True, sub="zero gradient", width=step_width)
                elif step < length:
                    _cell(axes, x, y, f"batch {step + 1}", DROPPED_COLOR, dashed=True, faded=True,
                          sub="not trained", width=step_width)
        bottom = rows[-1] - 0.3
        if mode == "join":
            axes.text(-0.1, bottom, "gradient: mean over", ha="right", va="center", fontsize=7)
            for step in range(longest):
                with_data = sum(length > step for length in lengths)
                label = f"{with_data} rank{'s' if with_data > 1 else ''}"
                axes.text((step + 0.5) * step_width, bottom, label, ha="center", va="center", fontsize=7)
        else:
            axes.plot([steps * step_width] * 2, [bottom + 0.15, rows[0] + 0.95], color="#c44e52", linewidth=1.5)
            axes.text(steps * step_width + 0.1, bottom, "epoch ends", ha="left", va="center", fontsize=7,
                      color="#c44e52")
    notes = (
        f"Streams of {', '.join(str(n) for n in lengths)} batches on ranks "
        f"{', '.join(str(r) for r in range(len(lengths)))}.",
        'join: a rank that ran out runs the step\'s collectives on a zero gradient ("no data", the model does '
        "not run);",
        "the step's gradient is the mean over the ranks that had a batch.",
        "drop: the epoch ends at the first step where some rank has no batch; the samples left are logged as",
        "uneven/dropped_samples.",
    )
    for line, text in enumerate(notes):
        axes.text(-1.5, -1.5 - 0.35 * line, text, fontsize=8)
    _save(figure, path)


def step_time_rows(report: dict[str, Any], rows: list[str] | None = None) -> list[str]:
    """The report's rows drawn in the step-time figure: ``rows`` (in that order), default every row with a
    ``ScalingReport`` breakdown; a named row without one is an error."""
    broken = [name for name, row in report["results"].items() if row.get("breakdown_ms_per_micro_batch")]
    if not broken:
        raise SystemExit("no row of this report has a time breakdown (the rows that run a ScalingReport have one)")
    if rows is None:
        return broken
    missing = [name for name in rows if name not in broken]
    if missing:
        raise SystemExit(f"rows without a time breakdown in this report: {', '.join(missing)} (with one: "
                         f"{', '.join(broken) or 'none'})")
    return rows


def draw_step_time(path: Path, bench: Path, rows: list[str] | None = None) -> None:
    """``step-time.svg``: the time per micro-batch by phase of ``bench``'s rows, stacked, drawn by the benchmark's
    ``--plots`` code; the machine and the report's name underneath."""
    from lightning_shardplus.bench.tables import _plot_step_breakdown

    report = json.loads(bench.read_text())
    chosen = step_time_rows(report, rows)
    shown = copy.deepcopy(report)
    shown["results"] = {name: report["results"][name] for name in chosen}
    figure, axes = plt.subplots(figsize=(9, 2.4 + 0.32 * len(chosen)), layout="constrained")
    _plot_step_breakdown(axes, shown)
    machine, settings = report.get("machine", {}), report.get("settings", {})
    device = machine.get("gpu") or f"{machine.get('cpu', '?')} ({machine.get('cpu_cores', '?')} cores)"
    figure.supxlabel(
        f"{bench.name}: {settings.get('devices', '?')} {settings.get('accelerator', 'cpu').upper()} "
        f"process{'' if settings.get('devices') == 1 else 'es'} on {device}, "
        f"torch {machine.get('torch', '?')}; an MLP {settings.get('input_dim', '?')} -> {settings.get('layers', '?')}"
        f" x {settings.get('hidden_dim', '?')} -> 10, global batch {settings.get('global_batch_size', '?')}",
        fontsize=8,
    )
    _save(figure, path)


def _save(figure: Any, path: Path) -> None:
    """Write ``figure`` as SVG without the date (the rest of the output is fixed by :data:`RC`)."""
    figure.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight", pad_inches=0.05)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[Path]:
    """Write the three figures; returns their paths."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, default=DEFAULT_BENCH, help="benchmark JSON report for step-time.svg "
                        "(written by `python -m lightning_shardplus.bench --json`)")
    parser.add_argument("--rows", type=lambda text: text.split(","), default=None,
                        help="comma-separated rows of the report for step-time.svg (default: every row with a "
                        "time breakdown)")
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: docs/figures)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [args.out / name for name in ("padded-vs-exact-shards.svg", "join-vs-drop.svg", "step-time.svg")]
    with plt.rc_context(RC):
        draw_shards(paths[0])
        draw_join_drop(paths[1])
        draw_step_time(paths[2], args.bench, args.rows)
    return paths


if __name__ == "__main__":
    for written in main():
        print(written)
