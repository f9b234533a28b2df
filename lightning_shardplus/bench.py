"""``python -m lightning_shardplus.bench``: the same synthetic workload under plain ``strategy="ddp"`` and
under shardplus configurations, run alternately and repeated, reported as samples/s and step time (medians),
the ratio to the first configuration run, and the Python-level collectives per step (``torch.distributed``
all_reduce and barrier calls, counted in every worker; DDP's gradient all-reduce runs in C++ and is not
counted).

Each run is a fresh ``Trainer.fit`` on CPU processes (fork launcher); the first ``--warmup`` steps are not
timed. Alternating the configurations spreads the machine's drift over all of them. ``--configs`` picks
some of them (the first one picked is the baseline of the ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_shardplus.datamodule import SyntheticDataModule
from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.strategy import ShardPlusStrategy


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: a name, how to build its strategy, and how many scalars the model logs per
    training step (1: the demo classifier's loss), with or without ``sync_dist=True``."""

    name: str
    make_strategy: Callable[[], Strategy]
    logged_scalars: int = 1
    sync_dist: bool = False


def default_configs() -> list[BenchConfig]:
    def shardplus(**kwargs: object) -> Callable[[], Strategy]:
        return lambda: ShardPlusStrategy(start_method="fork", **kwargs)

    return [
        BenchConfig("ddp", lambda: DDPStrategy(start_method="fork")),
        BenchConfig("shardplus", shardplus()),
        # 16 scalars logged per step: (a) no sync, (b) Lightning's sync_dist=True, (c) shardplus averaging
        BenchConfig("metrics16-nosync", shardplus(average_training_metrics=False), 16),
        BenchConfig("metrics16-sync_dist", shardplus(average_training_metrics=False), 16, sync_dist=True),
        BenchConfig("metrics16-averaged", shardplus(), 16),
        BenchConfig("metrics16-sync_dist-averaged", shardplus(), 16, sync_dist=True),
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


_COLLECTIVES = ("all_reduce", "barrier")
_counts = dict.fromkeys(_COLLECTIVES, 0)


@contextlib.contextmanager
def _counting_collectives() -> Iterator[None]:
    """Count ``torch.distributed.all_reduce``/``barrier`` calls in this process and the workers it forks."""
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            _counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in _COLLECTIVES:
            setattr(dist, name, counting(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


class _Threads(Callback):
    """Sets torch's intra-op threads in every worker (``--threads``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)


class _Throughput(Callback):
    """Times the training steps after ``warmup`` on rank 0 and writes samples/s, seconds per step and the
    collectives per step (counted from the first timed step to the end of the last one) to ``out``."""

    def __init__(self, warmup: int, out: Path) -> None:
        self.warmup, self.out, self.start = warmup, out, 0.0
        self.counts_at_start = self.counts_at_end = dict(_counts)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
            self.counts_at_start = dict(_counts)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts_at_end = dict(_counts)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            seconds = time.perf_counter() - self.start
            steps = trainer.global_step - self.warmup
            samples = steps * trainer.datamodule.effective_global_batch_size
            result = {"samples_per_s": samples / seconds, "s_per_step": seconds / steps, "steps": steps}
            for name in _COLLECTIVES:
                result[f"{name}_per_step"] = (self.counts_at_end[name] - self.counts_at_start[name]) / steps
            self.out.write_text(json.dumps(result))


def run_once(config: BenchConfig, args: argparse.Namespace) -> dict[str, float]:
    """One ``fit`` of the workload under ``config``; returns rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        pl.seed_everything(0, verbose=False)
        datamodule = SyntheticDataModule(
            global_batch_size=args.global_batch_size,
            num_samples=args.global_batch_size * (args.steps + args.warmup),
            val_samples=0,
            input_shape=(args.input_dim,),
        )
        shape = {"input_dim": args.input_dim, "hidden_dims": [args.hidden_dim] * args.layers}
        if config.logged_scalars == 1 and not config.sync_dist:
            model = ClassifierModule(**shape)
        else:
            model = ManyMetricsClassifier(config.logged_scalars, config.sync_dist, **shape)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=config.make_strategy(),
            max_steps=args.steps + args.warmup,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[_Throughput(args.warmup, out)] + ([_Threads(args.threads)] if args.threads else []),
        )
        with _counting_collectives():
            trainer.fit(model, datamodule)
        return json.loads(out.read_text())


def run(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, Any]:
    """Run every config ``args.repeats`` times, alternating; return per-config medians and ratios to the first
    config (the baseline)."""
    measured: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            measured[config.name].append(run_once(config, args))
    baseline = statistics.median(r["samples_per_s"] for r in measured[configs[0].name])
    rows = {}
    for name, runs in measured.items():
        values = [r["samples_per_s"] for r in runs]
        rows[name] = {
            "median_samples_per_s": statistics.median(values),
            "min_samples_per_s": min(values),
            "max_samples_per_s": max(values),
            "median_ms_per_step": 1000 * statistics.median(r["s_per_step"] for r in runs),
            "ratio_to_baseline": statistics.median(values) / baseline,
            **{f"{c}_per_step": statistics.median(r[f"{c}_per_step"] for r in runs) for c in _COLLECTIVES},
            "runs": values,
        }
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {"settings": settings, "baseline": configs[0].name, "results": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| configuration | samples/s (median) | min - max | ms/step (median) "
        f"| ratio to {report['baseline']} | all_reduce/step | barrier/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["results"].items():
        spread = f"{row['min_samples_per_s']:.0f} - {row['max_samples_per_s']:.0f}"
        lines.append(
            f"| {name} | {row['median_samples_per_s']:.0f} | {spread} | {row['median_ms_per_step']:.1f} "
            f"| {row['ratio_to_baseline']:.3f} "
            f"| {row['all_reduce_per_step']:g} | {row['barrier_per_step']:g} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_shardplus.bench", description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per configuration, alternating (default 5)"
    )
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run")
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads per process (default: torch's)"
    )
    names = [config.name for config in default_configs()]
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated configurations to run, the first is the baseline (default: all of {names})",
    )
    args = parser.parse_args(argv)
    if args.configs is not None:
        unknown = [name for name in args.configs.split(",") if name not in names]
        if unknown or not args.configs:
            parser.error(f"--configs={args.configs} is not valid: expected names from {names}")
    for name in ("devices", "repeats", "steps", "global_batch_size", "input_dim", "hidden_dim", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid: expected >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} is not valid: expected >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} is not valid: expected >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configs = {config.name: config for config in default_configs()}
    chosen = list(configs.values()) if args.configs is None else [configs[n] for n in args.configs.split(",")]
    report = run(chosen, args)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
