"""One ``fit`` per row (:func:`run_once`) and the alternating repeats of the matrix (:func:`run`), with the callbacks
that time the steps and count their collectives, and what the benchmark ran on (:func:`machine`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy

from lightning_shardplus.bench.quiet import quiet_run
from lightning_shardplus.bench.report_cost import measure_report_cost
from lightning_shardplus.bench.workloads import BenchConfig, RankStream, bench_model
from lightning_shardplus.data.aggregation import effective_batch_size
from lightning_shardplus.data.datamodule import SyntheticDataModule
from lightning_shardplus.diagnostics import STEP_PHASES, CollectiveCalls, CommunicationCounter, ScalingReport
from lightning_shardplus.gradients.ddp.fusion_cache import cpu_model
from lightning_shardplus.strategies.ddp import ShardPlusStrategy

_COLLECTIVES = ("all_reduce", "barrier")  # the kinds of collectives counted per optimizer step


class _Threads(Callback):
    """Sets torch's intra-op threads in every worker (``--threads``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)


def thread_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The callback that sets ``--threads`` in every worker, if it was given."""
    return [_Threads(args.threads)] if args.threads else []


class ReadsEveryStep(Callback):
    """Reads ``callback_metrics`` after every training batch, as a monitoring callback of your own may
    (``--read-every-step``): shardplus then averages the logged values in every step."""

    reads_step_values = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.callback_metrics  # noqa: B018 (the read is the point)


class Throughput(Callback):
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
    """The median over optimizer steps of a count; None without counted steps."""
    return statistics.median(step[key] for step in steps) if steps else None


def _median_per_run(values: list[float | None]) -> float | None:
    """The median over runs of a count; None when a run could not count it."""
    return None if None in values else statistics.median(values)


def bench_trainer(
    accelerator: str,
    devices: int,
    strategy: Strategy,
    max_steps: int,
    callbacks: list[Callback],
    logger: Logger | bool = False,
    log_every_n_steps: int | None = None,
) -> pl.Trainer:
    """A Trainer that trains ``max_steps`` and nothing else: no checkpoints, progress bar or validation, and no
    logger unless one is given."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )


@dataclass
class Workload:
    """One row's fit as every benchmark mode sets it up (seeded): its strategy, model and data, and its untimed
    and timed optimizer steps (micro-batches: times ``frequency``, the strategy's aggregation)."""

    config: BenchConfig
    strategy: Strategy
    model: pl.LightningModule
    datamodule: SyntheticDataModule
    frequency: int
    warmup_steps: int
    timed_steps: int

    @classmethod
    def of(cls, config: BenchConfig, args: argparse.Namespace) -> Workload:
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
        model = bench_model(config, args)
        return cls(config, strategy, model, datamodule, frequency, warmup_steps, timed_steps)

    def scaling_report(self, output_file: Path) -> list[Callback]:
        """The row's ``ScalingReport`` (timing the steps after the warmup) in a list, or none."""
        if not self.config.scaling_report:
            return []
        return [ScalingReport(skip_first_steps=self.warmup_steps * self.frequency, output_file=output_file,
                              verbose=False)]

    def fit(self, trainer: pl.Trainer, args: argparse.Namespace) -> None:
        """Train on the datamodule, or on the same samples as one stream per rank (``config.stream``)."""
        if self.config.stream:
            stream = RankStream(self.datamodule.build_train_dataset())
            batch = args.global_batch_size // args.devices
            trainer.fit(self.model, torch.utils.data.DataLoader(stream, batch_size=batch))
        else:
            trainer.fit(self.model, self.datamodule)


def run_once(config: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One ``fit`` of the workload under ``config``; returns rank 0's samples/s and, for shardplus rows, the
    counted communication per timed optimizer step."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        workload = Workload.of(config, args)
        counted = _counts_gradients(config, workload.strategy)
        report = workload.scaling_report(directory / "scaling.json")
        callbacks = [
            Throughput(workload.warmup_steps, directory / "result.json"),
            *([CommunicationCounter(directory / "counts")] if counted else []),
            *report,
            *thread_callbacks(args),
            *([ReadsEveryStep()] if args.read_every_step else []),
        ]
        steps = workload.timed_steps + workload.warmup_steps
        with quiet_run():
            workload.fit(bench_trainer(args.accelerator, args.devices, workload.strategy, steps, callbacks), args)
        return _run_result(directory, counted, workload.warmup_steps, bool(report))


def _counts_gradients(config: BenchConfig, strategy: Strategy) -> bool:
    """Whether the row counts its gradient communication: counting registers a Python all-reduce hook, so not on
    the rows compared with ddp, nor on the metric rows (compared with each other)."""
    many_metrics = config.logged_scalars != 1 or config.sync_dist
    return isinstance(strategy, ShardPlusStrategy) and config.count_gradients and not many_metrics


def _run_result(directory: Path, counted: bool, warmup_steps: int, scaled: bool) -> dict[str, Any]:
    """What rank 0 wrote in ``directory``: samples/s and collectives per step, the gradient communication per timed
    optimizer step (None where not counted) and the ScalingReport (None without one)."""
    result: dict[str, Any] = json.loads((directory / "result.json").read_text())
    steps = json.loads((directory / "counts" / "rank0.json").read_text())["steps"] if counted else []
    timed = steps[warmup_steps:]
    for key in ("bytes", "rounds", "collectives"):
        result[f"{key}_per_step"] = _median_per_step(timed, key)
    result["scaling"] = json.loads((directory / "scaling.json").read_text()) if scaled else None
    return result


def run(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, Any]:
    """Run every config ``args.repeats`` times, alternating; return per-config samples/s, ratios to the first
    config (ddp) and counted communication per optimizer step."""
    results = _alternating_runs(configs, args)
    baseline_runs = results[configs[0].name]
    baseline = statistics.median(r["samples_per_s"] for r in baseline_runs)
    rows = {name: ratio_row(runs, baseline, baseline_runs) for name, runs in results.items()}
    report = {"settings": report_settings(args), "machine": machine(args), "baseline": configs[0].name, "results": rows}
    if "shardplus-report" in rows:
        report["scaling_report_cost_us_per_micro_batch"] = measure_report_cost()
    return report


def _alternating_runs(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Each config's untimed preparation run, if any, then ``args.repeats`` runs of every config, in alternating
    order (the machine's drift is spread over all of them); the runs per config name."""
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    for config in configs:
        if config.prepare_steps:
            print(f"preparing {config.name}: {config.prepare_steps} untimed steps", flush=True)
            run_once(config, argparse.Namespace(**{**vars(args), "steps": config.prepare_steps}))
    total = args.repeats * len(configs)
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            results[config.name].append(run_once(config, args))
            done, rate = sum(len(runs) for runs in results.values()), results[config.name][-1]["samples_per_s"]
            print(f"run {done}/{total} {config.name}: {rate:.0f} samples/s", flush=True)
    return results


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of ``values``: the j-th smallest and the j-th largest
    value, j the largest rank at which the median lies outside with probability at most ``(1 - confidence) / 2``
    on each side (each value falls below the median with probability 1/2: a binomial count), so the coverage is
    at least ``confidence``. None where there are too few values for one (fewer than 6 at 95%).

    Example: 21 paired ratios give the 6th smallest and the 6th largest (97.3% coverage)."""
    ordered, n = sorted(values), len(values)
    tail, below, j = (1 - confidence) / 2, 0.0, 0
    while j < n:
        below += math.comb(n, j) / 2**n  # the probability that at most j values fall below the median
        if below > tail:
            break
        j += 1
    return None if j == 0 else (ordered[j - 1], ordered[n - j])


def ratio_row(runs: list[dict[str, Any]], baseline: float, baseline_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's row of the report: samples/s over its runs, its ratio to ``baseline`` (the baseline's median),
    the median of its paired ratios (each run over the baseline's run of the same round, run close to it: the
    machine's slow drift mostly cancels) with its 95% interval (:func:`median_interval`), its counts."""
    values = [r["samples_per_s"] for r in runs]
    paired = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(runs, baseline_runs, strict=True)]
    return {
        **throughput_figures(values, paired, baseline),
        "median_ms_per_step": 1000 * statistics.median(r["s_per_step"] for r in runs),
        **{f"{c}_per_step": _median_per_run([r[f"{c}_per_step"] for r in runs]) for c in _COLLECTIVES},
        # the same in every run of a config (the counts do not depend on timing); the first run's
        **{key: runs[0][key] for key in ("bytes_per_step", "rounds_per_step", "collectives_per_step")},
        "breakdown_ms_per_micro_batch": _median_breakdown([r["scaling"] for r in runs]),
    }


def throughput_figures(values: list[float], paired: list[float], baseline: float) -> dict[str, Any]:
    """A row's samples/s figures from its runs' ``values`` and their ``paired`` ratios to the baseline's run of the
    same round: median, range, ratio to ``baseline`` (the baseline's median), the paired median and its interval."""
    return {
        "median_samples_per_s": statistics.median(values),
        "min_samples_per_s": min(values),
        "max_samples_per_s": max(values),
        "ratio_to_baseline": statistics.median(values) / baseline,
        "paired_ratio_to_baseline": statistics.median(paired),
        # where the median of the paired ratios lies with 95% confidence (None with fewer than 6 runs)
        "paired_ratio_interval_95": median_interval(paired),
        "runs": values,
    }


def keep_parent_single_threaded() -> None:
    """One intra-op thread in this process, which forks the fits and times nothing itself. libgomp's thread pool
    does not survive a fork: once this process had run a parallel op, a fit's first parallel op hung in the child
    whenever the child had several threads (one process per machine of several cores: ``--devices 1``, or one
    GPU). Each fit's own threads stay Lightning's choice (cores / processes) or ``--threads``."""
    torch.set_num_threads(1)


def rows_from_workers(worker: Callable[..., None], args: argparse.Namespace) -> Any:
    """Run ``worker(rank, world_size, store, out, args)`` in ``--devices`` fork processes (this process is not one
    of them) and return what rank 0 wrote to ``out`` as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "rows.json")
        mp.start_processes(worker, (args.devices, store, out, args), nprocs=args.devices, start_method="fork")
        return json.loads(Path(out).read_text())


def report_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command's arguments as a report records them (paths as strings)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


def _median_breakdown(reports: list[dict[str, Any] | None]) -> dict[str, float] | None:
    """Per phase, the median over runs of the ScalingReport's milliseconds per micro-batch; None without one."""
    counted = [r for r in reports if r is not None and r.get("micro_batches")]
    if not counted:
        return None
    return {phase: statistics.median(r["ms_per_micro_batch"][phase] for r in counted) for phase in STEP_PHASES}


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """What the benchmark ran on: CPU, cores, accelerator and processes, library versions."""
    description: dict[str, Any] = {
        "cpu": cpu_model(),
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
