"""``python -m lightning_shardplus.bench``: the same synthetic workload under plain ``strategy="ddp"`` and
under shardplus configurations, run alternately and repeated, reported as samples/s (median) and ratio to ddp.

Each run is a fresh ``Trainer.fit`` on CPU processes (fork launcher) over the same number of micro-batches
(``--warmup`` untimed, then ``--steps`` timed), so a row with ``aggregation_frequency=A`` takes ``1/A`` as
many optimizer steps. Alternating the configurations spreads the machine's drift over all of them.

Beside samples/s, shardplus rows report what the gradient communication hook sent on rank 0 per optimizer step
during the timed steps (median), *counted* by :class:`~lightning_shardplus.instrumentation.CommunicationCounter`
(not estimated): bytes handed to collectives, all-reduce rounds (gradient synchronizations) and collectives.
Counting needs a hook, so the ``none`` row (``gradient_compression="none"``) runs torch's Python
``allreduce_hook``, the equivalent of DDP's built-in all-reduce that the ``ddp`` row uses (not counted). The
``shardplus`` (defaults) and ``shardplus-plain`` (``average_training_metrics=False``: no extra feature) rows, the
ones to compare with ``ddp``, run without the counting hook.

Every row also reports the step time and the Python-level ``torch.distributed`` all_reduce and barrier calls
per optimizer step, counted in every worker by :class:`~lightning_shardplus.instrumentation.CollectiveCalls` ("-"
where torch cannot count them; the metrics rows: 16 scalars logged per step with no sync, Lightning's
``sync_dist=True``, and shardplus averaging). ``--configs`` picks rows; the first is the baseline.

Rows other than ``ddp``, ``shardplus``, ``shardplus-plain`` and the metrics rows run a
:class:`~lightning_shardplus.callbacks.ScalingReport`: where each micro-batch's time goes (data, between steps,
forward, backward, exposed communication, optimizer; medians over the runs). The ``shardplus-report`` row is
``shardplus`` with the report: their ratio is the report's overhead. ``--quick`` runs the whole matrix in
shorter runs (about a minute on 2 CPU cores); ``--json``, ``--plots DIR`` (two PNGs: samples/s per row with
its spread, time per step by phase) and ``--markdown`` (the README's performance section) write the results;
``--from-json`` renders a report written before without running anything. ``--accelerator gpu`` (or ``auto``
with a GPU) runs one fork-launched process per GPU instead of CPU processes; the ScalingReport's figures are then
host-side times.

``--sampler`` runs a different benchmark, in this process and without training: for each dataset length N, rank
0's :class:`~lightning_shardplus.PaddedShardSampler` (on-the-fly permutation) beside torch's
``DistributedSampler`` (materialized ``randperm``, only up to ``--torch-max-length``): time to the first index,
indices per second per rank while iterating, and peak resident memory above the level before the sampler.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DistributedSampler

from lightning_shardplus.aggregation import effective_batch_size
from lightning_shardplus.callbacks import STEP_PHASES, ScalingReport
from lightning_shardplus.datamodule import SyntheticDataModule
from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.instrumentation import CollectiveCalls, CommunicationCounter
from lightning_shardplus.sharding import PaddedShardSampler
from lightning_shardplus.strategy import ShardPlusStrategy


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: a name, how to build its strategy, and how many scalars the model logs per
    training step (1: the demo classifier's loss), with or without ``sync_dist=True``."""

    name: str
    make_strategy: Callable[[], Strategy]
    logged_scalars: int = 1
    sync_dist: bool = False
    count_gradients: bool = True  # counting runs a Python all-reduce hook: off for the rows compared with ddp
    scaling_report: bool = True  # a ScalingReport callback: off for the rows compared with ddp
    prepare_steps: int = 0  # an untimed run of this many steps before the timed ones (the autotune row tunes in it)


def strategy_accepts(**kwargs: object) -> bool:
    """Whether ``ShardPlusStrategy`` takes these keyword arguments (rows of features not there yet are left out)."""
    parameters = inspect.signature(ShardPlusStrategy.__init__).parameters
    return all(name in parameters for name in kwargs)


# The autotune row's cache: one per benchmark process, never the user's `~/.cache` one.
_AUTOTUNE_CACHE = Path(tempfile.gettempdir()) / f"shardplus-bench-fusion-{os.getpid()}.json"


def default_configs() -> list[BenchConfig]:
    def shardplus(**kwargs: object) -> Callable[[], Strategy]:
        return lambda: ShardPlusStrategy(start_method="fork", **kwargs)

    def if_accepted(name: str, **kwargs: object) -> list[BenchConfig]:
        """The row of a strategy argument that may not exist yet on this branch (none or one row)."""
        return [BenchConfig(name, shardplus(**kwargs), prepare_steps=300)] if strategy_accepts(**kwargs) else []

    return [
        BenchConfig("ddp", lambda: DDPStrategy(start_method="fork"), scaling_report=False),
        # shardplus against ddp: its defaults (averaged training metrics: one all_reduce per step), and without
        # any extra feature; neither runs the counting hook nor the ScalingReport
        BenchConfig("shardplus", shardplus(), count_gradients=False, scaling_report=False),
        BenchConfig(
            "shardplus-plain", shardplus(average_training_metrics=False), count_gradients=False, scaling_report=False
        ),
        # the defaults with the ScalingReport: its overhead is this row against "shardplus"
        BenchConfig("shardplus-report", shardplus(), count_gradients=False),
        # gradient communication, counted: "none" is the uncompressed reference of the bytes
        BenchConfig("none", shardplus()),
        BenchConfig("agg4", shardplus(aggregation_frequency=4)),
        BenchConfig("agg8", shardplus(aggregation_frequency=8)),
        BenchConfig("fp16", shardplus(gradient_compression="fp16")),
        BenchConfig("bf16", shardplus(gradient_compression="bf16")),
        BenchConfig("powersgd", shardplus(gradient_compression="powersgd")),
        # bucket size chosen by measurement: an untimed run of 300 steps tunes (into a cache private to this
        # benchmark); the timed runs start from its result, as a user's second run would
        *if_accepted("autotune", auto_tune_tensor_fusion=True, autotune_cache=str(_AUTOTUNE_CACHE)),
        # 16 scalars logged per step: (a) no sync, (b) Lightning's sync_dist=True, (c) shardplus averaging
        # (no ScalingReport: its all-reduce hook would be counted among the Python all_reduce calls)
        BenchConfig("metrics16-nosync", shardplus(average_training_metrics=False), 16, scaling_report=False),
        BenchConfig(
            "metrics16-sync_dist", shardplus(average_training_metrics=False), 16, sync_dist=True, scaling_report=False
        ),
        BenchConfig("metrics16-averaged", shardplus(), 16, scaling_report=False),
        BenchConfig("metrics16-sync_dist-averaged", shardplus(), 16, sync_dist=True, scaling_report=False),
    ]


class ManyMetricsClassifier(ClassifierModule):
    """The demo classifier, logging ``logged_scalars`` scalars per training step: the loss and loss + k."""

    def __init__(self, logged_scalars: int, sync_dist: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged_scalars, self.sync_dist = logged_scalars, sync_dist

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        detached = loss.detach()
        self.log("train_loss", detached, prog_bar=True, sync_dist=self.sync_dist)
        for k in range(1, self.logged_scalars):
            self.log(f"train_metric_{k:02d}", detached + k, sync_dist=self.sync_dist)
        return loss


_COLLECTIVES = ("all_reduce", "barrier")  # the kinds of collectives counted per optimizer step


class _Threads(Callback):
    """Sets torch's intra-op threads in every worker (``--threads``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)


class _Throughput(Callback):
    """Times the optimizer steps after ``warmup`` on rank 0 and writes samples/s, seconds per step and the
    ``torch.distributed`` all_reduce and barrier calls per step (counted from the first timed step to the end of the
    last one; None where torch cannot count them) to ``out``."""

    def __init__(self, warmup: int, out: Path) -> None:
        self.warmup, self.out, self.start = warmup, out, 0.0
        self.collectives = CollectiveCalls()
        self.counted = False
        self.counts_at_start: dict[str, int] = {}
        self.counts_at_end: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.counted = self.collectives.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.collectives.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.collectives.stop()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and not self.start:
            self.start = time.perf_counter()
            self.counts_at_start = self.collectives.snapshot()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts_at_end = self.collectives.snapshot()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            seconds = time.perf_counter() - self.start
            steps = trainer.global_step - self.warmup
            samples = steps * effective_batch_size(trainer)
            result = {"samples_per_s": samples / seconds, "s_per_step": seconds / steps, "steps": steps}
            for name in _COLLECTIVES:
                issued = self.counts_at_end.get(name, 0) - self.counts_at_start.get(name, 0)
                result[f"{name}_per_step"] = issued / steps if self.counted else None
            self.out.write_text(json.dumps(result))


def _median_per_step(steps: list[dict[str, int]], key: str) -> float | None:
    return statistics.median(step[key] for step in steps) if steps else None


def _median_per_run(values: list[float | None]) -> float | None:
    """The median over runs of a count; None when a run could not count it."""
    return None if None in values else statistics.median(values)


def _bench_trainer(
    accelerator: str, devices: int, strategy: Strategy, max_steps: int, callbacks: list[Callback]
) -> pl.Trainer:
    """A Trainer that trains ``max_steps`` and nothing else: no logger, checkpoints, progress bar or validation."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )


def run_once(config: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One ``fit`` of the workload under ``config``; returns rank 0's samples/s and, for shardplus rows, the
    counted communication per timed optimizer step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        pl.seed_everything(0, verbose=False)
        strategy = config.make_strategy()
        frequency = getattr(strategy, "aggregation_frequency", 1)
        warmup_steps = math.ceil(args.warmup / frequency)
        timed_steps = max(1, args.steps // frequency)
        datamodule = SyntheticDataModule(
            global_batch_size=args.global_batch_size,
            num_samples=args.global_batch_size * frequency * (timed_steps + warmup_steps),
            val_samples=0,
            input_shape=(args.input_dim,),
        )
        shape = {"input_dim": args.input_dim, "hidden_dims": [args.hidden_dim] * args.layers}
        if config.logged_scalars == 1 and not config.sync_dist:
            model = ClassifierModule(**shape)
        else:
            model = ManyMetricsClassifier(config.logged_scalars, config.sync_dist, **shape)
        # Gradient counting registers a Python all-reduce hook; the metric rows count Python collectives instead.
        counted = isinstance(strategy, ShardPlusStrategy) and config.count_gradients and config.logged_scalars == 1
        counted = counted and not config.sync_dist
        counter = CommunicationCounter(Path(tmp) / "counts") if counted else None
        scaling = Path(tmp) / "scaling.json"
        report = (
            ScalingReport(skip_first_steps=warmup_steps * frequency, output_file=scaling, verbose=False)
            if config.scaling_report
            else None
        )
        trainer = _bench_trainer(
            args.accelerator,
            args.devices,
            strategy,
            timed_steps + warmup_steps,
            [
                _Throughput(warmup_steps, out),
                *([counter] if counter else []),
                *([report] if report else []),
                *([_Threads(args.threads)] if args.threads else []),
            ],
        )
        trainer.fit(model, datamodule)
        result: dict[str, Any] = json.loads(out.read_text())
        steps = json.loads((Path(tmp) / "counts" / "rank0.json").read_text())["steps"] if counter else []
        timed = steps[warmup_steps:]
        for key in ("bytes", "rounds", "collectives"):
            result[f"{key}_per_step"] = _median_per_step(timed, key)
        result["scaling"] = json.loads(scaling.read_text()) if report else None
        return result


def run(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, Any]:
    """Run every config ``args.repeats`` times, alternating; return per-config samples/s, ratios to the first
    config (ddp) and counted communication per optimizer step."""
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    for config in configs:
        if config.prepare_steps:
            run_once(config, argparse.Namespace(**{**vars(args), "steps": config.prepare_steps}))
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            results[config.name].append(run_once(config, args))
    baseline = statistics.median(r["samples_per_s"] for r in results[configs[0].name])
    rows = {}
    for name, runs in results.items():
        values = [r["samples_per_s"] for r in runs]
        rows[name] = {
            "median_samples_per_s": statistics.median(values),
            "min_samples_per_s": min(values),
            "max_samples_per_s": max(values),
            "median_ms_per_step": 1000 * statistics.median(r["s_per_step"] for r in runs),
            "ratio_to_baseline": statistics.median(values) / baseline,
            **{f"{c}_per_step": _median_per_run([r[f"{c}_per_step"] for r in runs]) for c in _COLLECTIVES},
            "runs": values,
            # the same in every run of a config (the counts do not depend on timing); the first run's
            **{key: runs[0][key] for key in ("bytes_per_step", "rounds_per_step", "collectives_per_step")},
            "breakdown_ms_per_micro_batch": _median_breakdown([r["scaling"] for r in runs]),
        }
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report = {"settings": settings, "machine": machine(args), "baseline": configs[0].name, "results": rows}
    if "shardplus-report" in rows:
        report["scaling_report_cost_us_per_micro_batch"] = measure_report_cost()
    return report


class _Bucket:
    """What ScalingReport's hook wrapper asks of a DDP bucket."""

    def is_last(self) -> bool:
        return True


def measure_report_cost(micro_batches: int = 5000, profiled_actions: int = 40) -> float:
    """An upper bound of ScalingReport's own work per micro-batch, in microseconds, timed in this process without
    training (the fastest of 7 rounds): its six hooks, its communication-hook wrapper (one bucket) and its
    profiler wrapper around Lightning's no-op profiler (the batch fetch and ``profiled_actions`` other actions
    Lightning profiles per step, including what the no-op profiler itself costs). Not in it: torch's Python
    ``allreduce_hook`` run instead of DDP's built-in all-reduce (the paired rows measure everything)."""
    from lightning.pytorch.profilers import PassThroughProfiler

    from lightning_shardplus._lightning import TRAIN_DATALOADER_NEXT
    from lightning_shardplus.callbacks import _FetchTimingProfiler

    report = ScalingReport(skip_first_steps=0, verbose=False)
    report._world_size, report._batch_size = 2, 1
    wrapped = _FetchTimingProfiler(PassThroughProfiler(), report)
    hook = report.wrap(lambda state, bucket: None)
    bucket, loss = _Bucket(), torch.zeros(())

    def profile_actions(profiler: Any) -> None:
        for _ in range(profiled_actions):
            with profiler.profile("[Callback]Other.on_train_batch_start"):
                pass

    trainer: Any = SimpleNamespace(strategy=SimpleNamespace(fusion_tuning=False))  # what the hooks read of it

    def one_step() -> None:
        report.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        report.on_before_backward(trainer, None, loss)  # type: ignore[arg-type]
        hook(None, bucket)
        report.on_after_backward(trainer, None)  # type: ignore[arg-type]
        report.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
        wrapped.start(TRAIN_DATALOADER_NEXT)
        wrapped.stop(TRAIN_DATALOADER_NEXT)
        profile_actions(wrapped)

    def seconds(step: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(micro_batches):
            step()
        return time.perf_counter() - start

    report._previous_end = time.perf_counter()
    return 1e6 * min(seconds(one_step) for _ in range(7)) / micro_batches


def _median_breakdown(reports: list[dict[str, Any] | None]) -> dict[str, float] | None:
    """Per phase, the median over runs of the ScalingReport's milliseconds per micro-batch; None without one."""
    counted = [r for r in reports if r is not None and r.get("micro_batches")]
    if not counted:
        return None
    return {phase: statistics.median(r["ms_per_micro_batch"][phase] for r in counted) for phase in STEP_PHASES}


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.machine()


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """What the benchmark ran on: CPU, cores, accelerator and processes, library versions."""
    description: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "accelerator": args.accelerator,
        "devices": args.devices,
        "threads_per_process": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "os": f"{platform.system()} {platform.release()}",
    }
    if args.accelerator == "gpu":
        description["gpu"] = torch.cuda.get_device_name(0)  # in this process only after the runs: fork-safe
    return description


def _count(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 1e6:.3f} MB" if value >= 1e5 else f"{value / 1e3:.1f} kB"
    return f"{value:g}"


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"| configuration | samples/s (median) | min - max | ms/step (median) | ratio to {report['baseline']} | "
        "gradient bytes / step | all-reduce rounds / step | collectives in hooks / step | "
        "all_reduce calls / step | barrier calls / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["results"].items():
        lines.append(
            f"| {name} | {row['median_samples_per_s']:.0f} | {row['min_samples_per_s']:.0f} - "
            f"{row['max_samples_per_s']:.0f} | {row['median_ms_per_step']:.1f} | {row['ratio_to_baseline']:.3f} | "
            f"{_count(row['bytes_per_step'], 'bytes')} | "
            f"{_count(row['rounds_per_step'])} | {_count(row['collectives_per_step'])} | "
            f"{_count(row['all_reduce_per_step'])} | {_count(row['barrier_per_step'])} |"
        )
    return "\n".join(lines)


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


def format_overhead(report: dict[str, Any]) -> str | None:
    """One sentence on :func:`report_overhead`; None without the two rows."""
    overhead = report_overhead(report)
    if overhead is None:
        return None
    text = (
        f"`ScalingReport` overhead: {overhead['paired']:.1%} fewer samples/s for `shardplus-report` than `shardplus` "
        f"(median of {len(report['results']['shardplus']['runs'])} paired runs; range {overhead['paired_min']:.1%} to "
        f"{overhead['paired_max']:.1%})"
    )
    if "own_work" in overhead:
        text += (
            f"; its own work, timed alone, is at most {report['scaling_report_cost_us_per_micro_batch']:.1f} us per "
            f"micro-batch, {overhead['own_work']:.2%} of a step"
        )
    return text + "."


def format_markdown(report: dict[str, Any]) -> str:
    """The README's performance section: the machine, the command's settings, the two tables, the overhead."""
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
    rows = report["results"]
    names = list(rows)
    width, height = PLOT_SIZE
    paths = [directory / "samples_per_second.png", directory / "step_breakdown.png"]

    figure, axes = plt.subplots(figsize=(width / PLOT_DPI, height / PLOT_DPI), dpi=PLOT_DPI, layout="constrained")
    axes.bar(names, [rows[n]["median_samples_per_s"] for n in names], color="#4c72b0", label="median")
    for index, name in enumerate(names):
        runs = rows[name]["runs"]
        axes.plot([index] * len(runs), runs, "o", color="black", markersize=3, label="runs" if index == 0 else None)
    axes.set_ylabel("samples/s")
    axes.set_title(f"Samples/s per configuration ({report['settings']['devices']} processes; bars: median)")
    axes.tick_params(axis="x", labelrotation=60)
    axes.legend()
    figure.savefig(paths[0], dpi=PLOT_DPI)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(width / PLOT_DPI, height / PLOT_DPI), dpi=PLOT_DPI, layout="constrained")
    broken = [n for n in names if rows[n].get("breakdown_ms_per_micro_batch")]
    left = [0.0] * len(broken)
    for phase in STEP_PHASES:
        values = [rows[n]["breakdown_ms_per_micro_batch"][phase] for n in broken]
        axes.barh(broken, values, left=left, label=phase.replace("_", " "))
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.invert_yaxis()
    axes.set_xlabel("ms per micro-batch (median over runs)")
    axes.set_title("Where each step's time goes (ScalingReport)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(STEP_PHASES), fontsize="small")
    figure.savefig(paths[1], dpi=PLOT_DPI)
    plt.close(figure)
    return paths


PLOT_DPI = 100
PLOT_SIZE = (1000, 500)  # pixels


SAMPLER_SIZES = (10**6, 10**8, 10**9, 10**12)


class _Length:
    """A dataset of a given length that holds nothing (all the samplers ask for)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def _proc_status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (VmHWM) to the current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def measure_sampler(make: Callable[[], Iterable[int]], indices: int) -> dict[str, Any]:
    """Time to the first index (construction and ``iter`` included), indices/s over the next ``indices - 1``,
    and the peak resident memory above the level before (None where /proc cannot tell)."""
    gc.collect()
    resettable = _reset_peak_rss()
    before = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    iterator = iter(make())
    next(iterator)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    rest = sum(1 for _ in itertools.islice(iterator, indices - 1))
    seconds = time.perf_counter() - start
    peak = _proc_status_kib("VmHWM")
    del iterator
    gc.collect()
    return {
        "first_index_ms": first_s * 1e3,
        "indices_per_s": rest / seconds if rest else None,
        "indices_timed": rest,
        "peak_memory_mb": (peak - before) / 1024 if resettable and peak is not None and before is not None else None,
    }


def run_sampler(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--sampler`` rows: shardplus's sampler for every length, torch's DistributedSampler where it fits."""
    rows = []
    world = args.devices
    for length in args.sampler_sizes:
        indices = max(1, min(args.sampler_indices, length // world))
        makers: list[tuple[str, Callable[[], Iterable[int]]]] = [
            ("shardplus PaddedShardSampler", lambda n=length: PaddedShardSampler(n, world, 0, seed=0)),
        ]
        if length <= args.torch_max_length:
            makers.append(
                ("torch DistributedSampler", lambda n=length: DistributedSampler(_Length(n), world, 0, seed=0))
            )
        for name, make in makers:
            rows.append({"sampler": name, "length": length, "num_replicas": world, **measure_sampler(make, indices)})
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {"settings": settings, "sampler_rows": rows}


def format_sampler_table(report: dict[str, Any]) -> str:
    lines = [
        "| N | sampler | first index | indices/s per rank | peak memory |",
        "|---:|---|---:|---:|---:|",
    ]
    for row in report["sampler_rows"]:
        rate = "-" if row["indices_per_s"] is None else f"{row['indices_per_s'] / 1e6:.1f} M"
        memory = "-" if row["peak_memory_mb"] is None else f"{row['peak_memory_mb']:.0f} MB"
        lines.append(
            f"| {_length_text(row['length'])} | {row['sampler']} | {row['first_index_ms']:.2f} ms | {rate} | {memory} |"
        )
    return "\n".join(lines)


def _length_text(length: int) -> str:
    power = len(str(length)) - 1
    return f"10^{power}" if length == 10**power and power >= 3 else str(length)


def _length_list(text: str) -> list[int]:
    """``"1e6,10**8,5000"`` -> ``[1000000, 100000000, 5000]``."""
    values = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        base, power = item.split("**") if "**" in item else (item, "1")
        mantissa, exponent = base.lower().split("e") if "e" in base.lower() else (base, "0")
        values.append((int(mantissa) * 10 ** int(exponent)) ** int(power))
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_shardplus.bench", description=__doc__)
    parser.add_argument(
        "--devices", type=int, default=None, help="processes: one per GPU with --accelerator=gpu, else 2 (default)"
    )
    parser.add_argument(
        "--accelerator", choices=("auto", "cpu", "gpu"), default="cpu",
        help="cpu (default): CPU processes on gloo; gpu: one process per GPU on NCCL; auto: gpu if there is one",
    )
    parser.add_argument(
        "--repeats", type=int, default=None,
        help=f"runs per configuration, alternating (default 5; --quick {QUICK['repeats']})",
    )
    parser.add_argument(
        "--steps", type=int, default=None,
        help=f"timed micro-batches per run (optimizer steps if not aggregating; default 100, --quick {QUICK['steps']})",
    )
    parser.add_argument(
        "--warmup", type=int, default=None,
        help=f"untimed micro-batches at the start of each run (default 10; --quick {QUICK['warmup']})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the whole matrix in short runs: about a minute on 2 CPU cores"
    )
    parser.add_argument("--plots", type=Path, default=None, help="write the two PNG plots to this directory")
    parser.add_argument("--markdown", action="store_true", help="also print the README's performance section")
    parser.add_argument(
        "--from-json", type=Path, default=None,
        help="render a report written by --json (tables, --markdown, --plots) instead of running",
    )
    parser.add_argument(
        "--configs", default=None,
        help=f"comma-separated rows to run, ddp first as the baseline (default all: "
        f"{','.join(c.name for c in default_configs())})",
    )
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads per process (default: torch's)"
    )
    parser.add_argument(
        "--sampler", action="store_true",
        help="benchmark the samplers instead of training (rank 0 of --devices ranks; see above)",
    )
    parser.add_argument(
        "--sampler-sizes", type=_length_list, default=list(SAMPLER_SIZES),
        help="with --sampler: comma-separated dataset lengths (default 1e6,1e8,1e9,1e12)",
    )
    parser.add_argument(
        "--sampler-indices", type=int, default=2_000_000,
        help="with --sampler: indices timed per row for indices/s (default 2,000,000)",
    )
    parser.add_argument(
        "--torch-max-length", type=_length_list, default=[10**8],
        help="with --sampler: largest N run with torch's DistributedSampler, which materializes the whole "
        "permutation as a Python list (about 50 bytes per sample: 5 GB at 1e8; default 1e8)",
    )
    _add_fusion_arguments(parser)
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.accelerator == "auto":
        args.accelerator = "gpu" if num_cuda_devices() > 0 else "cpu"
    if args.devices is None:
        args.devices = num_cuda_devices() if args.accelerator == "gpu" else 2
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} is not valid: expected >= 1")
    args.torch_max_length = args.torch_max_length[0] if args.torch_max_length else 0
    if args.sampler_indices < 1 or not args.sampler_sizes or min(args.sampler_sizes) < 1:
        parser.error("--sampler-indices and --sampler-sizes are not valid: expected integers >= 1")
    if max(args.sampler_sizes) > 2**63 - 1:
        parser.error("--sampler-sizes is not valid: expected lengths <= 2**63 - 1")
    for name in ("devices", "repeats", "steps", "global_batch_size", "input_dim", "hidden_dim", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid: expected >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} is not valid: expected >= 0")
    if args.configs is not None:
        known = [c.name for c in default_configs()]
        chosen = [name.strip() for name in args.configs.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            parser.error(f"--configs={args.configs!r} is not valid: expected names among {', '.join(known)}")
        args.configs = chosen
    return args


FULL = {"repeats": 5, "steps": 100, "warmup": 10}
QUICK = {"repeats": 2, "steps": 24, "warmup": 6}


def select_configs(names: list[str] | None) -> list[BenchConfig]:
    """The default configs named in ``names`` (all if None), in the default order."""
    configs = default_configs()
    return configs if names is None else [c for c in configs if c.name in names]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
    elif args.sampler:
        report = run_sampler(args)
    elif args.fusion:
        report = run_fusion(args)
    else:
        report = run(select_configs(args.configs), args)
    if "sampler_rows" in report:
        print(format_sampler_table(report))
    elif "fusion_rows" in report:
        print(format_fusion_table(report))
    else:
        print(format_table(report))
        print()
        print(format_breakdown_table(report))
        overhead = format_overhead(report)
        if overhead is not None:
            print("\n" + overhead)
        if args.markdown:
            print("\n" + format_markdown(report))
        if args.plots is not None:
            for path in write_plots(report, args.plots):
                print(f"wrote {path}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report



# ---------------------------------------------------------------------------------------------------- --fusion
#
# Tensor-fusion autotuning: per model shape, one fit on --devices CPU ranks that tunes the bucket size
# (auto_tune_tensor_fusion, no cache) and then, in the same processes, measures the fixed candidates and the tuned
# setting interleaved (DDP re-wrapped between samples): the tuned setting's throughput relative to the best
# fixed candidate and to DDP's default (what strategy="ddp" uses), and what tuning cost relative to a 2,000-step run.

FUSION_SHAPES = "many-small:256:256:24,few-large:1024:2048:3"
FUSION_REFERENCE_RUN_STEPS = 2000


def _positive_ints(text: str) -> list[int]:
    """``N`` or ``N,M,...``, each >= 1."""
    items = text.split(",")
    if not all(item.strip().isdigit() and int(item) >= 1 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 1, or a comma-separated list of them")
    return [int(item) for item in items]


def _fusion_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """``name:input_dim:hidden_dim:layers,...``."""
    shapes = []
    for item in text.split(","):
        name, *numbers = item.strip().split(":")
        if len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"{item!r}: expected name:input_dim:hidden_dim:layers")
        shapes.append((name, *(int(n) for n in numbers)))
    return shapes


class _InterleavedBuckets(Callback):
    """Once tuning is over: samples of ``warmup + steps`` optimizer steps under each setting (``fixed``, and the
    tuned one where it is not among them) and, as a control, the tuned setting a second time (``CONTROL``: what
    two measurements of one setting differ by is the noise of this run), in rounds of alternating order, DDP
    re-wrapped between samples; then stops the fit. A sample's time is the median step on each rank, MAX over
    ranks; rank 0 writes them to ``out``."""

    CONTROL = "tuned, measured again"

    def __init__(self, fixed: list[Any], steps: int, warmup: int, rounds: int, out: Path) -> None:
        self.fixed, self.steps, self.warmup, self.rounds, self.out = fixed, steps, warmup, rounds, out
        self.schedule: list[Any] | None = None
        self.samples: list[list[float]] = []
        self.boundaries = 0
        self.last = 0.0
        self.done = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ShardPlusStrategy)
        if strategy.fusion_result is None or i % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        last, self.last = self.last, now
        if self.schedule is None:  # the first step after tuning
            tuned = strategy.fusion_result.setting
            self.settings = {self.CONTROL: tuned} | {s.label: s for s in self.fixed} | {tuned.label: tuned}
            labels = list(self.settings)
            self.schedule = [s for r in range(self.rounds) for s in (labels if r % 2 == 0 else labels[::-1])]
            self.samples = [[] for _ in self.schedule]
            strategy.rewrap_ddp(self.settings[self.schedule[0]])
            return
        if self.done:
            return
        # boundary k ends step k after the first re-wrap: step k belongs to sample (k - 1) // length
        self.boundaries += 1
        length = self.warmup + self.steps
        sample, position = divmod(self.boundaries - 1, length)
        if position >= self.warmup and i > 0:  # a step that spans an epoch end is not timed
            self.samples[sample].append(now - last)
        if self.boundaries % length == 0:
            following = self.boundaries // length
            if following == len(self.schedule):
                self.done = trainer.should_stop = True
            elif self.schedule[following] != self.schedule[following - 1]:
                strategy.rewrap_ddp(self.settings[self.schedule[following]])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.schedule is not None, "tuning did not finish: raise max_steps"
        assert self.done, "the interleaved measurement did not finish: raise max_steps"
        medians = [statistics.median(s) if s else 0.0 for s in self.samples]
        tensor = torch.tensor(medians, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        if trainer.is_global_zero:
            result = trainer.strategy.fusion_result
            per_setting: dict[str, list[float]] = {}
            for label, seconds in zip(self.schedule, tensor.tolist(), strict=False):
                per_setting.setdefault(label, []).append(seconds)
            self.out.write_text(
                json.dumps(
                    {
                        "settings": list(self.settings),
                        "tuned": result.setting.label,
                        "samples_s": per_setting,
                        "tuning_steps": result.tuning_steps,
                        "tuning_s": result.tuning_s,
                        "tuning_step_ms": None if result.step_s is None else 1000 * result.step_s,
                        "summary": result.summary(),
                    }
                )
            )


def run_fusion_shape(shape: tuple[str, int, int, int], rounds: int, args: argparse.Namespace) -> dict[str, Any]:
    """Tune, then measure ``rounds`` interleaved rounds, on one model shape; returns the row."""
    from lightning_shardplus.fusion import (
        DDP_DEFAULT,
        DEFAULT_BUCKET_CAP_MB,
        DEFAULT_CANDIDATES_MB,
        AutotuneSettings,
        BucketSetting,
        bucket_layout,
        merge_equivalent,
    )

    name, input_dim, hidden_dim, layers = shape
    candidates = list(args.fusion_candidates or DEFAULT_CANDIDATES_MB)
    model = ClassifierModule(input_dim=input_dim, hidden_dims=[hidden_dim] * layers)
    parameters = list(model.parameters())
    settings = AutotuneSettings(
        candidates_mb=tuple(candidates), steps_per_sample=args.fusion_steps, warmup_steps=args.fusion_warmup
    )
    # the fixed settings measured: what tuning races first, one per distinct bucket layout (sizes that cut this
    # model's gradients the same way are one setting): the candidates and DDP's default (plain "ddp")
    uniform = BucketSetting(DEFAULT_BUCKET_CAP_MB)
    fixed, merged = merge_equivalent(
        settings.first_stage, lambda setting: bucket_layout(parameters, setting), (DDP_DEFAULT, uniform)
    )
    labels = {s.label: s.label + "".join(f" = {o.label}" for o in merged.get(s, [])) for s in fixed}
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "fusion.json", Path(tmp) / "samples.csv"
        pl.seed_everything(0, verbose=False)
        strategy = ShardPlusStrategy(
            start_method="fork",
            auto_tune_tensor_fusion=True,
            autotune_candidates_mb=candidates,
            autotune_steps_per_sample=args.fusion_steps,
            autotune_warmup_steps=args.fusion_warmup,
            autotune_cache=False,
            autotune_log=str(log),
        )
        measured = (len(fixed) + 2) * rounds * (args.fusion_warmup + args.fusion_steps)
        max_steps = settings.max_tuning_steps + measured + 10
        trainer = _bench_trainer(
            "cpu",
            args.devices,
            strategy,
            max_steps,
            [
                _InterleavedBuckets(fixed, args.fusion_steps, args.fusion_warmup, rounds, out),
                *([_Threads(args.threads)] if args.threads else []),
            ],
        )
        datamodule = SyntheticDataModule(
            global_batch_size=args.global_batch_size,
            num_samples=args.global_batch_size * (max_steps + 1),
            val_samples=0,
            input_shape=(input_dim,),
        )
        trainer.fit(model, datamodule)
        report = json.loads(out.read_text())
        report["csv"] = log.read_text().splitlines()
    step_s = {label: statistics.median(values) for label, values in report["samples_s"].items()}
    fixed_s = {s.label: step_s[s.label] for s in fixed}
    best_fixed = min(fixed_s, key=fixed_s.__getitem__)
    tuned_s = step_s[report["tuned"]]
    def label_of(setting: Any) -> str | None:
        return next((s.label for s in fixed if setting in (s, *merged.get(s, []))), None)

    default_label = label_of(DDP_DEFAULT)
    uniform_label = label_of(uniform)  # None when no candidate cuts the gradients as a uniform 25 MB does
    # What the tuning steps cost beyond running them all at the tuned speed (re-wraps and bucket rebuilds
    # included), relative to a 2,000-step run; the tuned speed as measured while tuning, against the same drift.
    during = report["tuning_step_ms"] / 1000 if report["tuning_step_ms"] else tuned_s
    cost = (report["tuning_s"] - report["tuning_steps"] * during) / (FUSION_REFERENCE_RUN_STEPS * during)
    def paired(label: str) -> float:
        """Median over rounds of (label's step time / tuned step time) within the same round: drift cancels."""
        rounds = zip(report["samples_s"][label], report["samples_s"][report["tuned"]], strict=True)
        return statistics.median(other / tuned for other, tuned in rounds)

    return {
        "shape": name,
        "parameters": sum(p.numel() for p in parameters),
        "tuned": labels.get(report["tuned"], report["tuned"]),
        "best_fixed": labels[best_fixed],
        "ms_per_step": {labels.get(label, label): 1000 * seconds for label, seconds in step_s.items()},
        "samples_ms": {
            labels.get(label, label): [round(1000 * v, 2) for v in values]
            for label, values in report["samples_s"].items()
        },
        # throughput ratios (tuned / other): from the medians, and paired round by round; the default is DDP's
        # (25 MB, first bucket 1 MB: what strategy="ddp" uses), the uniform 25 MB beside it
        "tuned_vs_best_fixed": fixed_s[best_fixed] / tuned_s,
        "tuned_vs_default": step_s[default_label] / tuned_s,
        "tuned_vs_uniform_25": step_s[uniform_label] / tuned_s if uniform_label else None,
        "tuned_vs_best_fixed_paired": paired(best_fixed),
        # the control: the tuned setting measured twice in each round; how far from 1 this is, is this run's noise
        "tuned_vs_itself": step_s[_InterleavedBuckets.CONTROL] / tuned_s,
        "tuned_vs_itself_paired": paired(_InterleavedBuckets.CONTROL),
        "tuned_vs_default_paired": paired(default_label),
        "tuned_vs_uniform_25_paired": paired(uniform_label) if uniform_label else None,
        "tuning_steps": report["tuning_steps"],
        "tuning_cost_of_2000_steps": cost,
        "samples_per_setting": len(next(iter(report["samples_s"].values()))),
        "csv_rows": len(report["csv"]) - 1,
        "csv": report["csv"],
        "summary": report["summary"],
    }


def run_fusion(args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.fusion_rounds * len(args.fusion_shapes) if len(args.fusion_rounds) == 1 else args.fusion_rounds
    if len(rounds) != len(args.fusion_shapes):
        raise SystemExit(
            f"--fusion-rounds={','.join(map(str, args.fusion_rounds))}: expected one number, or one per shape "
            f"({len(args.fusion_shapes)})"
        )
    rows = [run_fusion_shape(shape, n, args) for shape, n in zip(args.fusion_shapes, rounds, strict=True)]
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {"settings": settings, "fusion_rows": rows}


def _add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fusion", action="store_true",
        help="benchmark tensor-fusion autotuning instead (see the end of this module): per --fusion-shapes, tune, "
        "then measure the fixed candidates and the tuned setting interleaved",
    )
    parser.add_argument("--fusion-shapes", type=_fusion_shapes, default=_fusion_shapes(FUSION_SHAPES),
                        help=f"with --fusion: name:input_dim:hidden_dim:layers,... (default {FUSION_SHAPES})")
    parser.add_argument("--fusion-candidates", type=lambda t: [float(v) for v in t.split(",")], default=None,
                        help="with --fusion: candidate bucket sizes in MB (default: the strategy's)")
    parser.add_argument("--fusion-steps", type=int, default=8, help="with --fusion: timed steps per sample (8)")
    parser.add_argument("--fusion-warmup", type=int, default=1, help="with --fusion: untimed steps per sample (1)")
    parser.add_argument("--fusion-rounds", type=_positive_ints, default=[5],
                        help="with --fusion: interleaved rounds measured after tuning, one number or one per shape "
                        "(default 5; a noisier shape needs more to resolve 1-2%% differences)")


def format_fusion_table(report: dict[str, Any]) -> str:
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


if __name__ == "__main__":
    main()
